//! Argument checks and launches: the forward, the VJP and its column sums.

use super::choose::*;
use super::*;
use crate::ops::col_sums::{self, ColumnSum};

/// The grid of a split-row spec whose clusters loop over `rows`: as many clusters as the GPU
/// holds at once (of `block` threads and `shared` dynamic bytes). Where the call claims its rows
/// at run time (`claims_rows`) every one of them; otherwise balanced over the rows, and a
/// multiple of `period` (`granule_period`) where clusters take several rows each, so that every
/// row a cluster takes lies in its granules as the first does (the kernels' shifted columns then
/// move whole vectors).
pub(super) fn cluster_grid(
    kernel: &LoadedKernel,
    spec: &KernelSpec,
    block: usize,
    shared: usize,
    rows: usize,
    period: usize,
) -> Result<SplitGrid> {
    let slots = kernel.max_active_clusters(block as u32, shared)?;
    let claims = claims_rows(spec, rows, slots);
    let clusters = if claims {
        slots
    } else if rows <= slots || period == 1 {
        balanced_grid(rows, slots)
    } else {
        // Fewer slots than the period: a second wave of clusters, still right (kiln's own
        // choices never come here: shifted_grid_idles sends them to the unshifted spec).
        let slots = (slots / period).max(1) * period;
        let turns = rows.div_ceil(slots);
        rows.div_ceil(turns).next_multiple_of(period)
    };
    Ok(SplitGrid {
        blocks: clusters * constant(spec, "CLUSTER"),
        clusters,
        slots,
        claims,
    })
}

/// A split-row launch's grid (`cluster_grid`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitGrid {
    /// Blocks launched: `clusters` times the spec's cluster width.
    pub blocks: usize,
    /// Clusters, each looping over rows.
    pub clusters: usize,
    /// Clusters the GPU holds at once (`max_active_clusters`).
    pub slots: usize,
    /// Whether the clusters claim their rows at run time (`claims_rows`).
    pub claims: bool,
}

/// The rows after which a split spec's rows start as the first did again, where its columns are
/// shifted (vectors on rows that are alike but not aligned); 1 elsewhere.
pub(super) fn shift_period(spec: &KernelSpec, layout: Rows, strides: &[i64]) -> usize {
    if layout == Rows::Alike && spec.n_reads > 1 && shifts_columns(spec.template) {
        granule_period(strides, spec.dtype.size())
    } else {
        1
    }
}

/// Whether a split spec with shifted columns would idle too much of the GPU on `rows`: where
/// clusters take several rows each its grid is a multiple of `period` clusters, and where that
/// costs more than an eighth more turns than the GPU's cluster slots would take (a judgement: the
/// shifted 16-bit forward ran 1.02-1.33x the unshifted one on full grids), the unshifted spec is
/// the faster. Measured on an H200 with the VJP shifted: clusters of 7 had 15 slots, a grid of 8
/// ran at half the speed of one element a vector on 15.
fn shifted_grid_idles(
    kernel: &LoadedKernel,
    spec: &KernelSpec,
    rows: usize,
    d: usize,
    period: usize,
) -> Result<bool> {
    if period == 1 {
        return Ok(false);
    }
    let shared = launch_bytes(spec, d);
    kernel.allow_shared(shared)?;
    let slots = kernel.max_active_clusters(spec.block_dim as u32, shared)?;
    if rows <= slots {
        return Ok(false);
    }
    let kept = slots / period * period;
    Ok(kept == 0 || 8 * rows.div_ceil(kept) > 9 * rows.div_ceil(slots))
}

/// Rows after which views of rows `strides` elements apart (of `size`-byte elements) all start
/// at the same offset within their 16-byte granules again: 1 when every row does.
pub(super) fn granule_period(strides: &[i64], size: usize) -> usize {
    strides
        .iter()
        .map(|&stride| {
            let bytes = (stride.rem_euclid(16) as usize * size) % 16;
            if bytes == 0 {
                1
            } else {
                16 >> bytes.trailing_zeros()
            }
        })
        .max()
        .unwrap_or(1)
}

/// The longest row the kernels take: they index a row with 32-bit ints (`int d`), and step
/// past its end by up to a block's span, so rows stay well below 2^31 elements.
pub const MAX_ROW: usize = 1 << 30;

/// An error naming `arg` when rows of `d` elements are longer than the kernels index.
pub(super) fn check_row(arg: &'static str, d: usize) -> Result<()> {
    if d > MAX_ROW {
        return Err(bad(
            arg,
            format!(
                "rows of {d} elements are longer than the norm kernels index with 32-bit ints \
                 (at most {MAX_ROW})"
            ),
        ));
    }
    Ok(())
}

/// Checks x's shape and eps; returns d, the length of x's last axis, over which it is
/// normalised.
pub(super) fn row_length(x_shape: &[usize], eps: f32) -> Result<usize> {
    let Some(&d) = x_shape.last() else {
        return Err(bad(
            "x",
            "must have at least one axis (normalised over the last)".into(),
        ));
    };
    if eps.is_nan() || eps < 0.0 || eps.is_infinite() {
        return Err(bad("eps", format!("must be finite and >= 0, got {eps}")));
    }
    check_row("x", d)?;
    Ok(d)
}

/// Checks x, eps, and an optional 1-D parameter of length d and x's dtype.
pub(super) fn check_inputs(
    x: &Array,
    params: &[(&'static str, Option<&Array>)],
    eps: f32,
) -> Result<usize> {
    let d = row_length(x.shape(), eps)?;
    for (name, p) in params {
        let Some(p) = p else { continue };
        if p.shape() != [d] {
            // 1-D, of x's last axis' length.
            return Err(Error::ShapeMismatch {
                arg: name,
                expected: vec![d],
                got: p.shape().to_vec(),
            });
        }
        if p.dtype() != x.dtype() {
            return Err(Error::DTypeMismatch {
                arg: name,
                expected: x.dtype(),
                got: p.dtype(),
            });
        }
        if p.device().ordinal() != x.device().ordinal() {
            return Err(Error::DeviceMismatch {
                arg: name,
                expected: x.device().ordinal(),
                got: p.device().ordinal(),
            });
        }
    }
    Ok(d)
}

/// x as rows of d elements with unit stride: (the array to read, its row stride). Views whose
/// leading axes collapse into one stride are read in place; anything else is copied once.
pub(super) fn as_rows(enc: &mut CommandEncoder, x: &Array) -> Result<(Array, i64)> {
    let n = x.ndim();
    let d = x.shape()[n - 1];
    let unit_last = d <= 1 || x.strides()[n - 1] == 1;
    let mut row_stride: Option<isize> = None;
    let mut collapses = unit_last;
    // Walk the leading axes inwards-out: each must step over the whole of the ones inside it.
    let mut inner: Option<(isize, usize)> = None; // (stride, extent) of the next inner axis > 1
    for i in (0..n - 1).rev() {
        let (extent, stride) = (x.shape()[i], x.strides()[i]);
        if extent <= 1 {
            continue;
        }
        match inner {
            None => row_stride = Some(stride),
            Some((s, e)) => collapses &= stride == s * e as isize,
        }
        inner = Some((stride, extent));
    }
    if collapses && row_stride.unwrap_or(0) >= 0 {
        return Ok((x.clone(), row_stride.unwrap_or(d as isize) as i64));
    }
    let c = x.contiguous(enc)?;
    Ok((c, d as i64))
}

pub(super) fn aligned(a: &Array) -> bool {
    a.device_ptr() % 16 == 0
}

/// How row views (device address, row stride in elements) of `d` elements, and an output of
/// rows `d` apart at a fresh (aligned) address, lie in their granules: 16-byte loads legal on
/// every row, rows alike (each starting as far into its granule as the same row of the others),
/// or neither.
pub(super) fn row_layout(dtype: DType, d: usize, views: &[(u64, i64)]) -> Rows {
    let v = dtype.vec_width() as i64;
    let all_aligned = views.iter().all(|&(address, _)| address % 16 == 0);
    if all_aligned && d as i64 % v == 0 && views.iter().all(|(_, stride)| stride % v == 0) {
        Rows::Aligned
    } else if all_aligned
        && views
            .iter()
            .all(|(_, stride)| stride.rem_euclid(v) == d as i64 % v)
    {
        Rows::Alike
    } else {
        Rows::Scattered
    }
}

pub(super) fn param_args(p: Option<&Array>, rows: Rows) -> (u64, i64, i32) {
    match p {
        None => (0, 0, 0),
        Some(p) => {
            let stride = p.strides()[0] as i64;
            let vec = rows == Rows::Aligned && stride == 1 && aligned(p);
            (p.device_ptr(), stride, vec as i32)
        }
    }
}

pub(super) fn geometry(spec: &KernelSpec) -> (usize, usize) {
    let block = spec.block_dim as usize;
    if is_split(spec) {
        return (block, 1);
    }
    let group = constant(spec, "GROUP");
    (block, block / group)
}

pub(super) fn forward(
    enc: &mut CommandEncoder,
    kind: Kind,
    x: &Array,
    w: Option<&Array>,
    b: Option<&Array>,
    eps: f32,
    chosen: Option<KernelSpec>,
) -> Result<Array> {
    let d = check_inputs(x, &[("weight", w), ("bias", b)], eps)?;
    let y = Array::empty_on(enc, x.dtype(), x.shape())?;
    if x.size() == 0 {
        return Ok(y);
    }
    let rows = x.size() / d;
    let (xr, x_stride) = as_rows(enc, x)?;
    let layout = row_layout(x.dtype(), d, &[(xr.device_ptr(), x_stride)]);
    let (gpu, count) = (Gpu::of(enc.device()), Count::of(rows, enc.device()));
    let spec = match chosen {
        Some(spec) => check_chosen(spec, Pass::Forward, kind, x.dtype(), d, layout)?,
        None => choose_spec(Pass::Forward, kind, x.dtype(), d, layout, count, gpu),
    };
    let (spec, kernel) = match enc.device().loaded(&spec) {
        Some(kernel) => (spec, kernel),
        None => {
            // A first forward of this shape: training calls the VJP next (with a cotangent laid
            // out like x), whose kernel and column sums compile in the background meanwhile.
            let next = [
                choose_spec(Pass::Vjp, kind, x.dtype(), d, layout, count, gpu),
                col_sums::spec_for(x.dtype(), d),
            ];
            if chosen.is_some() {
                enc.device().prefetch(next);
                (spec, enc.device().kernel(&spec)?)
            } else {
                stand_in::kernel_for(enc.device(), spec, &next)?
            }
        }
    };
    // Shifted columns on a grid cut too short for them: one element a vector instead.
    let period = shift_period(&spec, layout, &[x_stride, d as i64]);
    let (spec, kernel, period) =
        if chosen.is_none() && shifted_grid_idles(&kernel, &spec, rows, d, period)? {
            let spec = choose_spec(
                Pass::Forward,
                kind,
                x.dtype(),
                d,
                Rows::Scattered,
                count,
                gpu,
            );
            let (spec, kernel) = stand_in::kernel_for(enc.device(), spec, &[])?;
            (spec, kernel, 1)
        } else {
            (spec, kernel, period)
        };
    let (wp, ws, wv) = param_args(w, layout);
    let (bp, bs, bv) = param_args(b, layout);
    let mut args = KernelArgs::new();
    args.push(xr.device_ptr())
        .push(wp)
        .push(bp)
        .push(y.device_ptr())
        .push(rows as i64)
        .push(d as i32)
        .push(x_stride)
        .push(ws)
        .push(bs)
        .push(wv)
        .push(bv)
        .push(eps);
    let (block, groups) = geometry(&spec);
    let shared = launch_bytes(&spec, d);
    let grid = if is_split(&spec) {
        // Clusters of consecutive blocks loop over rows: as many as the GPU holds at once.
        kernel.allow_shared(shared)?;
        let SplitGrid { blocks, claims, .. } =
            cluster_grid(&kernel, &spec, block, shared, rows, period)?;
        if *spec.template == FORWARD_STAGED {
            // The rows' counter: scratch the kernel leaves zero, no dependency
            // (CommandEncoder::claim_counter). None (null) where the rows are fixed, or where
            // the commit has no counter left: the kernel then takes its rows in turn, right for
            // any grid.
            let counter = if claims { enc.claim_counter()? } else { None };
            args.push(counter.unwrap_or(0));
        }
        blocks
    } else if shared > 0 {
        // Each block loops over rows, with the next rows' loads in flight.
        kernel.allow_shared(shared)?;
        resident_grid(enc, &kernel, block, shared, rows.div_ceil(groups))?
    } else {
        rows.div_ceil(groups)
    };
    let mut reads = vec![&xr];
    reads.extend(w);
    reads.extend(b);
    // SAFETY: the arguments are norm_fwd's (or norm_fwd_split's, or norm_fwd_staged's) in order
    // and type; x's rows, the weight and bias (when given) are read and y written, within the
    // rows x d elements and strides checked above; the staged kernel's row counter is the
    // encoder's scratch, left zero. Every norm template waits for the previous grid before its
    // first global access (kiln_wait_for_previous_grid).
    unsafe {
        enc.launch_dependent(
            &kernel,
            grid as u32,
            block as u32,
            shared as u32,
            args,
            &reads,
            &[&y],
        )
    }?;
    Ok(y)
}

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last axis.
pub fn layer_norm(
    enc: &mut CommandEncoder,
    x: &Array,
    weight: Option<&Array>,
    bias: Option<&Array>,
    eps: f32,
) -> Result<Array> {
    forward(enc, Kind::LayerNorm, x, weight, bias, eps, None)
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last axis.
pub fn rms_norm(
    enc: &mut CommandEncoder,
    x: &Array,
    weight: Option<&Array>,
    eps: f32,
) -> Result<Array> {
    forward(enc, Kind::RmsNorm, x, weight, None, eps, None)
}

pub(super) fn zeros(enc: &mut CommandEncoder, dtype: DType, n: usize) -> Result<Array> {
    Array::from_f64(enc, dtype, &vec![0.0; n], &[n])
}

/// (dx, dweight if weight, dbias if want_db).
#[allow(clippy::too_many_arguments)]
pub(super) fn vjp(
    enc: &mut CommandEncoder,
    kind: Kind,
    x: &Array,
    w: Option<&Array>,
    want_db: bool,
    g: &Array,
    eps: f32,
    chosen: Option<KernelSpec>,
) -> Result<(Array, Option<Array>, Option<Array>)> {
    let d = check_inputs(x, &[("weight", w)], eps)?;
    if g.shape() != x.shape() {
        return Err(Error::ShapeMismatch {
            arg: "cotangent",
            expected: x.shape().to_vec(),
            got: g.shape().to_vec(),
        });
    }
    if g.dtype() != x.dtype() {
        return Err(Error::DTypeMismatch {
            arg: "cotangent",
            expected: x.dtype(),
            got: g.dtype(),
        });
    }
    let dx = Array::empty_on(enc, x.dtype(), x.shape())?;
    let dtype = x.dtype();
    if x.size() == 0 {
        // No rows: the parameter gradients are sums over nothing.
        let dw = w.map(|_| zeros(enc, dtype, d)).transpose()?;
        let db = if want_db {
            Some(zeros(enc, dtype, d)?)
        } else {
            None
        };
        return Ok((dx, dw, db));
    }
    let rows = x.size() / d;
    let (xr, xs) = as_rows(enc, x)?;
    let (gr, gs) = as_rows(enc, g)?;
    let layout = row_layout(dtype, d, &[(xr.device_ptr(), xs), (gr.device_ptr(), gs)]);
    let (spec, kernel) = match chosen {
        Some(spec) => {
            let spec = check_chosen(spec, Pass::Vjp, kind, dtype, d, layout)?;
            (spec, enc.device().kernel(&spec)?)
        }
        None => {
            let (gpu, count) = (Gpu::of(enc.device()), Count::of(rows, enc.device()));
            let spec = choose_spec(Pass::Vjp, kind, dtype, d, layout, count, gpu);
            stand_in::kernel_for(enc.device(), spec, &[])?
        }
    };
    let (block, groups) = geometry(&spec);
    // The looped path keeps its partial sums in shared memory when two rows of d floats fit.
    let looped = constant(&spec, "ITEMS") == 0;
    let smem_bytes = 2 * d * 4;
    let smem_partials =
        looped && (w.is_some() || want_db) && smem_bytes + 1024 <= enc.device().shared_limit();
    let shared = if smem_partials {
        smem_bytes
    } else {
        ring_bytes(&spec)
    };
    kernel.allow_shared(shared)?;
    // Each block (split rows: each cluster) loops over rows, writing one partial row of dweight
    // and dbias, so fewer blocks means fewer partial rows to reduce.
    let (grid, partial_rows) = if is_vjp_split(&spec) {
        let period = shift_period(&spec, layout, &[xs, gs, d as i64]);
        let grid = cluster_grid(&kernel, &spec, block, shared, rows, period)?;
        (grid.blocks, grid.clusters)
    } else {
        let grid = resident_grid(enc, &kernel, block, shared, rows.div_ceil(groups))?;
        (grid, grid)
    };
    // The partial sums of dweight then dbias, [sets, partial_rows, d], reduced in one launch.
    let sets = w.is_some() as usize + want_db as usize;
    let partial = (sets > 0)
        .then(|| Array::empty_on(enc, DType::F32, &[sets, partial_rows, d]))
        .transpose()?;
    let set_ptr = |set: usize| {
        partial
            .as_ref()
            .map_or(0, |p| p.device_ptr() + (set * partial_rows * d * 4) as u64)
    };
    let (pw, pb) = match (w.is_some(), want_db) {
        (true, true) => (set_ptr(0), set_ptr(1)),
        (true, false) => (set_ptr(0), 0),
        (false, true) => (0, set_ptr(0)),
        (false, false) => (0, 0),
    };
    let (wp, ws, wv) = param_args(w, layout);
    let mut args = KernelArgs::new();
    args.push(xr.device_ptr())
        .push(wp)
        .push(gr.device_ptr())
        .push(dx.device_ptr())
        .push(pw)
        .push(pb)
        .push(rows as i64)
        .push(d as i32)
        .push(xs)
        .push(gs)
        .push(ws)
        .push(wv)
        .push(eps)
        .push(smem_partials as i32);
    let mut reads = vec![&xr, &gr];
    reads.extend(w);
    let mut writes = vec![&dx];
    writes.extend(partial.as_ref());
    // SAFETY: the arguments are the VJP templates' in order and type; x, the cotangent and the
    // weight are read, dx and the f32 partial rows written, within the shapes checked above and
    // the partial rows sized for this grid; both templates wait for the previous grid before
    // their first global access.
    unsafe {
        enc.launch_dependent(
            &kernel,
            grid as u32,
            block as u32,
            shared as u32,
            args,
            &reads,
            &writes,
        )
    }?;
    let dw = w.map(|_| Array::empty_on(enc, dtype, &[d])).transpose()?;
    let db = if want_db {
        Some(Array::empty_on(enc, dtype, &[d])?)
    } else {
        None
    };
    if let Some(partial) = &partial {
        let outs: Vec<&Array> = dw.iter().chain(db.iter()).collect();
        ColumnSum::load(enc.device(), dtype, d)?.launch(enc, partial, partial_rows, d, &outs)?;
    }
    Ok((dx, dw, db))
}

/// Column sums of an f32 [rows, d] array, as `dtype`. Another rank or dtype is an error.
pub fn reduce_cols(enc: &mut CommandEncoder, partial: &Array, dtype: DType) -> Result<Array> {
    let &[rows, d] = partial.shape() else {
        return Err(bad(
            "partial",
            format!("must be 2-D [rows, d], got shape {:?}", partial.shape()),
        ));
    };
    if partial.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch {
            arg: "partial",
            expected: DType::F32,
            got: partial.dtype(),
        });
    }
    check_row("partial", d)?;
    if d == 0 {
        return Array::empty_on(enc, dtype, &[0]);
    }
    // The kernel reads rows `d` apart: a view is copied once.
    let partial = partial.contiguous(enc)?;
    let partial = &partial;
    let out = Array::empty_on(enc, dtype, &[d])?;
    ColumnSum::load(enc.device(), dtype, d)?.launch(enc, partial, rows, d, &[&out])?;
    Ok(out)
}

/// LayerNorm's VJP: (dx, dweight if weight is given, dbias if bias is given).
pub fn layer_norm_vjp(
    enc: &mut CommandEncoder,
    x: &Array,
    weight: Option<&Array>,
    bias: Option<&Array>,
    cotangent: &Array,
    eps: f32,
) -> Result<(Array, Option<Array>, Option<Array>)> {
    if let Some(b) = bias {
        check_inputs(x, &[("bias", Some(b))], eps)?;
    }
    vjp(
        enc,
        Kind::LayerNorm,
        x,
        weight,
        bias.is_some(),
        cotangent,
        eps,
        None,
    )
}

/// RMSNorm's VJP: (dx, dweight if weight is given).
pub fn rms_norm_vjp(
    enc: &mut CommandEncoder,
    x: &Array,
    weight: Option<&Array>,
    cotangent: &Array,
    eps: f32,
) -> Result<(Array, Option<Array>)> {
    let (dx, dw, _) = vjp(enc, Kind::RmsNorm, x, weight, false, cotangent, eps, None)?;
    Ok((dx, dw))
}
