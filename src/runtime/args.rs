//! Kernel arguments passed by value: packed into one aligned byte buffer, with the pointer array
//! `cuLaunchKernel` and kernel graph nodes take. The driver copies the values at launch or node
//! creation, so nothing is copied to the device per launch.

use std::ffi::c_void;

/// Up to 512 bytes of arguments (a kernel may take up to 4 KiB; kiln's take far less).
const CAPACITY_WORDS: usize = 64;
const MAX_ARGS: usize = 24;
/// The widest alignment a parameter may need: a CUDA tensor map (`CUtensorMap`, 128 bytes) is
/// 64-byte aligned on the device, and the driver's CUDA 13 header declares it 128-byte aligned.
pub const MAX_ARG_ALIGN: usize = 128;

/// Storage for the values, aligned for any parameter.
#[derive(Clone, Copy)]
#[repr(C, align(128))]
struct Storage([u64; CAPACITY_WORDS]);

/// One launch's kernel arguments, by value and in parameter order, as
/// [`CommandEncoder::launch`](super::CommandEncoder::launch) takes them. A fixed-size value:
/// building one allocates nothing.
#[derive(Clone)]
pub struct KernelArgs {
    /// The values, each at an offset that is a multiple of its alignment.
    words: Storage,
    /// Byte offset of each argument in `words`.
    offsets: [u16; MAX_ARGS],
    count: usize,
    used: usize,
    /// Why a push was refused (too many arguments, or too wide an alignment): the launch that
    /// takes these arguments returns it as an error.
    refused: Option<&'static str>,
}

impl Default for KernelArgs {
    fn default() -> Self {
        KernelArgs {
            words: Storage([0; CAPACITY_WORDS]),
            offsets: [0; MAX_ARGS],
            count: 0,
            used: 0,
            refused: None,
        }
    }
}

impl KernelArgs {
    /// No arguments yet.
    pub fn new() -> KernelArgs {
        KernelArgs::default()
    }

    /// Appends one argument. `T` must have the layout the kernel parameter has (a `#[repr(C)]`
    /// struct, an integer, a float, a device address as `u64`, or a
    /// [`TensorMap`](super::tensor_map::TensorMap) for a `const __grid_constant__` parameter).
    ///
    /// Arguments beyond kiln's fixed capacity (512 bytes, 24 arguments), or a `T` that needs
    /// more than 128-byte alignment, are refused: the value is dropped, and the launch given
    /// these arguments returns `Error::InvalidArgument` (arg `args`) saying why (see
    /// [`KernelArgs::refused`]).
    pub fn push<T: Copy + 'static>(&mut self, value: T) -> &mut Self {
        let size = std::mem::size_of::<T>();
        let align = std::mem::align_of::<T>();
        if self.refused.is_some() {
            return self;
        }
        if align > MAX_ARG_ALIGN {
            self.refused = Some("an argument needs more than the 128-byte alignment kiln packs");
            return self;
        }
        let offset = self.used.div_ceil(align) * align;
        if self.count >= MAX_ARGS || offset + size > CAPACITY_WORDS * 8 {
            self.refused = Some("more than 24 arguments or 512 bytes of them");
            return self;
        }
        // SAFETY: the destination range lies inside `words` (checked above); T is Copy.
        unsafe {
            let dst = (self.words.0.as_mut_ptr() as *mut u8).add(offset);
            std::ptr::copy_nonoverlapping(&value as *const T as *const u8, dst, size);
        }
        self.offsets[self.count] = offset as u16;
        self.count += 1;
        self.used = offset + size;
        self
    }

    /// Why a push was refused, if one was: such arguments cannot be launched.
    pub fn refused(&self) -> Option<&'static str> {
        self.refused
    }

    /// The number of arguments pushed.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether no argument has been pushed.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Whether `other` has the same number of arguments at the same offsets: the parameter
    /// layout of one kernel function (values may differ).
    pub fn same_layout(&self, other: &KernelArgs) -> bool {
        self.count == other.count && self.offsets[..self.count] == other.offsets[..other.count]
    }

    /// The bytes of all arguments (for comparing two launches).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `used` bytes of `words` are initialised.
        unsafe { std::slice::from_raw_parts(self.words.0.as_ptr() as *const u8, self.used) }
    }

    /// Each argument's bytes (the padding after it included).
    pub fn values(&self) -> impl Iterator<Item = &[u8]> {
        let bytes = self.bytes();
        (0..self.count).map(move |i| {
            let start = self.offsets[i] as usize;
            let end = self.offsets.get(i + 1).filter(|_| i + 1 < self.count);
            &bytes[start..end.map_or(bytes.len(), |&e| e as usize)]
        })
    }

    /// The pointer array the driver takes; valid while `self` is neither moved nor changed.
    pub fn pointers(&mut self) -> [*mut c_void; MAX_ARGS] {
        let base = self.words.0.as_mut_ptr() as *mut u8;
        let mut out = [std::ptr::null_mut(); MAX_ARGS];
        for (i, p) in out.iter_mut().enumerate().take(self.count) {
            // SAFETY: every offset lies inside `words`.
            *p = unsafe { base.add(self.offsets[i] as usize) } as *mut c_void;
        }
        out
    }
}

impl PartialEq for KernelArgs {
    fn eq(&self, other: &Self) -> bool {
        self.same_layout(other) && self.bytes() == other.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_many_or_too_wide_arguments_are_refused_not_a_panic() {
        let mut a = KernelArgs::new();
        for i in 0..MAX_ARGS as u32 {
            a.push(i);
        }
        assert_eq!(a.refused(), None);
        a.push(1u32).push(2u64);
        assert!(a.refused().unwrap().contains("24 arguments"));
        assert_eq!(a.len(), MAX_ARGS, "refused values are dropped");
        let mut big = KernelArgs::new();
        big.push([0u64; CAPACITY_WORDS]).push(1u8);
        assert!(big.refused().is_some(), "past 512 bytes");
        #[derive(Clone, Copy)]
        #[repr(align(256))]
        struct Wide(#[allow(dead_code)] u8);
        let mut wide = KernelArgs::new();
        wide.push(Wide(0));
        assert!(wide.refused().unwrap().contains("alignment"));
        assert_eq!(wide.len(), 0);
    }

    #[test]
    fn values_are_aligned_and_readable() {
        let mut a = KernelArgs::new();
        a.push(7u8)
            .push(0x1122_3344_5566_7788u64)
            .push(2.5f32)
            .push(-3i32);
        assert_eq!(a.len(), 4);
        let p = a.pointers();
        unsafe {
            assert_eq!(*(p[0] as *const u8), 7);
            assert_eq!(p[1] as usize % 8, 0);
            assert_eq!(*(p[1] as *const u64), 0x1122_3344_5566_7788);
            assert_eq!(*(p[2] as *const f32), 2.5);
            assert_eq!(*(p[3] as *const i32), -3);
        }
    }

    #[test]
    fn structs_by_value() {
        #[repr(C)]
        #[derive(Clone, Copy)]
        struct Layout {
            shape: [i64; 3],
            rank: i32,
        }
        let mut a = KernelArgs::new();
        a.push(1u32).push(Layout {
            shape: [4, 5, 6],
            rank: 3,
        });
        let p = a.pointers();
        let l = unsafe { *(p[1] as *const Layout) };
        assert_eq!((l.shape, l.rank), ([4, 5, 6], 3));
    }

    #[test]
    fn a_tensor_map_is_64_byte_aligned() {
        #[repr(C, align(64))]
        #[derive(Clone, Copy)]
        struct TensorMap([u64; 16]);
        let map = TensorMap(std::array::from_fn(|i| i as u64 * 3 + 1));
        let mut a = KernelArgs::new();
        a.push(5u32).push(map).push(9u64);
        let p = a.pointers();
        assert_eq!(p[1] as usize % 64, 0);
        assert_eq!(p[1] as usize - p[0] as usize, 64);
        let got = unsafe { *(p[1] as *const TensorMap) };
        assert_eq!(got.0, map.0);
        assert_eq!(unsafe { *(p[2] as *const u64) }, 9);
        assert_eq!(a.values().nth(1).map(<[u8]>::len), Some(128));
    }

    #[test]
    fn equality_compares_values() {
        let mut a = KernelArgs::new();
        a.push(1u64).push(2.0f32);
        let mut b = KernelArgs::new();
        b.push(1u64).push(2.0f32);
        assert!(a == b);
        b.push(0u8);
        assert!(a != b);
    }
}
