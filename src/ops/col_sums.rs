//! Column sums of f32 partials: `out[c] = sum over r of partial[r * d + c]`, stored as the
//! output's dtype, added in a fixed order so that the result does not change from run to run
//! (`templates/reduce_cols.cu`). The norms' VJP sums its per-block dweight and dbias partials
//! with it, and a convolution pass that splits its reduction its per-split weight gradients.

use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::jit::{KernelSpec, LoadedKernel, TemplateDef};
use crate::runtime::{Array, CommandEncoder, Device, KernelArgs};

/// Column sums of f32 matrices, stored as the dtype (`templates/reduce_cols.cu`).
pub static REDUCE_COLS: TemplateDef = TemplateDef {
    name: "reduce_cols",
    source: include_str!("../../templates/reduce_cols.cu"),
    kernel: "kiln_reduce_cols",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

/// Threads a block of the column sum (column threads x row lanes).
const BLOCK: usize = 256;

/// The column sum storing `dtype`, each thread summing `columns_per_thread` adjacent columns
/// (4: one 16-byte load per row).
pub fn reduce_cols_spec(dtype: DType, columns_per_thread: usize) -> KernelSpec {
    KernelSpec::new(
        &REDUCE_COLS,
        dtype,
        BLOCK as u16,
        columns_per_thread as u8,
        &[],
    )
}

/// The column sum of rows `d` columns wide: 16-byte loads when every row starts 16-byte
/// aligned.
pub fn spec_for(dtype: DType, d: usize) -> KernelSpec {
    reduce_cols_spec(dtype, if d % 4 == 0 { 4 } else { 1 })
}

/// Every column-sum spec, for `kiln warm`.
pub fn specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for dtype in DType::ALL {
        for columns_per_thread in [1, 4] {
            out.push(reduce_cols_spec(dtype, columns_per_thread));
        }
    }
    out
}

/// Rows a lane sums at once (the kernel's UNROLL: loads in flight a thread).
const UNROLL: usize = 4;

/// Column threads per block (the rest of the block are row lanes), a power of two. Where there
/// are rows for every lane of 32 column threads to sum [`UNROLL`] at once: as many as 32 (whole
/// 128-byte rows per warp), fewer while that leaves the GPU's SMs with under two blocks each,
/// down to one 32-byte sector per row; so few columns and many rows (a norm's partials of
/// d = 768 over hundreds of blocks, a depthwise weight gradient's 1,296 values over 256 splits)
/// take few column threads and many row lanes. With fewer rows, so many column threads that each
/// lane has that many (up to the whole block along the columns): a grouped convolution's weight
/// gradient of 294,912 values in 16 splits takes four lanes of 64.
pub(crate) fn col_threads(
    rows: usize,
    d: usize,
    sets: usize,
    columns_per_thread: usize,
    sms: usize,
) -> usize {
    let wide = (BLOCK * UNROLL)
        .div_ceil(rows.max(1))
        .next_power_of_two()
        .min(BLOCK);
    if wide > 32 {
        return wide;
    }
    let fewest = 8 / columns_per_thread;
    let mut col_threads = 32;
    while col_threads > fewest && d.div_ceil(col_threads * columns_per_thread) * sets < 2 * sms {
        col_threads /= 2;
    }
    col_threads
}

/// A loaded column sum: the kernel of one output dtype and row width.
#[derive(Clone)]
pub struct ColumnSum {
    spec: KernelSpec,
    kernel: Arc<LoadedKernel>,
}

impl ColumnSum {
    /// The column sum storing `dtype` over rows `d` wide, loaded on `device` (compiled if it
    /// is not cached yet).
    pub fn load(device: &Device, dtype: DType, d: usize) -> Result<ColumnSum> {
        let spec = spec_for(dtype, d);
        Ok(ColumnSum {
            spec,
            kernel: device.kernel(&spec)?,
        })
    }

    /// Column sums of `outs.len()` (1 or 2) f32 [rows, d] matrices stored one after another in
    /// `partial`, into `outs`, in one launch. Outputs of another dtype or width than the loaded
    /// kernel's, or buffers too small for the sums, are an error.
    pub fn launch(
        &self,
        enc: &mut CommandEncoder,
        partial: &Array,
        rows: usize,
        d: usize,
        outs: &[&Array],
    ) -> Result<()> {
        let bad = |arg: &'static str, reason: String| Error::InvalidArgument { arg, reason };
        let (Some(first), Some(last)) = (outs.first(), outs.last()) else {
            return Err(bad("outs", "no output to sum into".into()));
        };
        if outs.len() > 2 {
            return Err(bad(
                "outs",
                format!("at most 2 sets a launch, got {}", outs.len()),
            ));
        }
        if d > i32::MAX as usize - BLOCK * 4 {
            return Err(bad("d", format!("{d} columns do not fit 32-bit indices")));
        }
        if spec_for(first.dtype(), d) != self.spec {
            return Err(bad(
                "outs",
                format!(
                    "{} of rows {d} wide need another kernel than the one loaded ({})",
                    first.dtype(),
                    self.spec
                ),
            ));
        }
        if partial.dtype() != DType::F32 || partial.size() < rows * d * outs.len() {
            return Err(bad(
                "partial",
                format!(
                    "must hold {} x {rows} x {d} f32, got {} {}",
                    outs.len(),
                    partial.size(),
                    partial.dtype()
                ),
            ));
        }
        if let Some(o) = outs
            .iter()
            .find(|o| o.dtype() != first.dtype() || o.size() < d)
        {
            return Err(bad(
                "outs",
                format!(
                    "each must hold {d} {}, got {} {}",
                    first.dtype(),
                    o.size(),
                    o.dtype()
                ),
            ));
        }
        let sms = enc.device().info().multiprocessors as usize;
        let columns_per_thread = self.spec.n_reads as usize;
        let col_threads = col_threads(rows, d, outs.len(), columns_per_thread, sms);
        let mut args = KernelArgs::new();
        args.push(partial.device_ptr())
            .push(first.device_ptr())
            .push(last.device_ptr())
            .push(rows as i64)
            .push(d as i32)
            .push(col_threads as i32);
        let blocks = d.div_ceil(col_threads * columns_per_thread).max(1);
        // SAFETY: the arguments are reduce_cols' in order and type, for the kernel of the
        // outputs' dtype (checked above); partial holds rows x d f32 a set, and set blockIdx.y
        // is summed into the first output (0) or the last (1), each of d elements; the kernel
        // waits for the previous grid before its first global access.
        unsafe {
            enc.launch_dependent(
                &self.kernel,
                (blocks as u32, outs.len() as u32, 1),
                BLOCK as u32,
                0,
                args,
                &[partial],
                outs,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_threads_spread_narrow_matrices_over_the_gpu() {
        // Wide rows keep whole 128-byte warps.
        assert_eq!(col_threads(512, 1 << 20, 1, 4, 132), 32);
        // A depthwise 3x3 weight gradient of 144 channels (1,296 columns) in 256 splits.
        assert_eq!(col_threads(256, 1296, 1, 4, 132), 2);
        assert_eq!(col_threads(256, 1296, 1, 1, 132), 8);
        // Never below one 32-byte sector a row.
        assert_eq!(col_threads(600, 4, 2, 4, 132), 2);
        // Few rows: each lane sums four at once, the whole block along the columns at most.
        assert_eq!(col_threads(16, 294_912, 1, 4, 132), 64);
        assert_eq!(col_threads(2, 294_912, 1, 4, 132), 256);
        assert_eq!(col_threads(0, 10, 1, 1, 132), 256);
        assert_eq!(col_threads(32, 1296, 1, 4, 132), 2);
        assert_eq!(col_threads(31, 1296, 1, 4, 132), 64);
    }

    #[test]
    fn spec_widths_follow_alignment() {
        assert_eq!(spec_for(DType::F16, 1296).n_reads, 4);
        assert_eq!(spec_for(DType::F16, 1294).n_reads, 1);
        assert!(specs().contains(&spec_for(DType::BF16, 6)));
    }
}
