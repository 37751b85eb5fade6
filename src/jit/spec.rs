//! What an op asks the JIT for: a template family and its specialisation.

use std::fmt;
use std::hash::{Hash, Hasher};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// The most named constants one template family may take.
pub const MAX_CONSTS: usize = 12;

/// A kernel family: one handlebars CUDA source in `templates/`, embedded at compile time.
///
/// A family is identified by this value's address (it lives in a `static`): two families never
/// compare equal, whatever their names. Names must still be unique in a process (the family
/// registry, `jit::family`, refuses a second family under a taken name). Comparing and hashing
/// by address keeps [`KernelSpec`] a small `Copy` value.
///
/// Define a family in a `static`, never a `const` (each use of a `const` is a new value).
#[derive(Debug)]
pub struct TemplateDef {
    /// Unique family name, also the template's name in the handlebars registry.
    pub name: &'static str,
    /// The template text (`include_str!` of a file under `templates/`).
    pub source: &'static str,
    /// The `__global__` function the module exposes (an NVRTC name expression).
    pub kernel: &'static str,
    /// Names of the specialisation constants, in the order of [`KernelSpec::consts`].
    pub const_names: &'static [&'static str],
    /// Whether the family needs the arch-specific target (`sm_90a`) to compile.
    pub arch_specific: bool,
    /// The one architecture the family is written for (its instructions exist nowhere else),
    /// or None for every architecture kiln supports.
    pub only_arch: Option<u32>,
}

impl PartialEq for TemplateDef {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}
impl Eq for TemplateDef {}
impl Hash for TemplateDef {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self as *const TemplateDef as usize).hash(state)
    }
}

/// One specialisation of a template family. This is the in-memory key of a kernel: small, `Copy`
/// and hashable, never a formatted string.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelSpec {
    /// The family.
    pub template: &'static TemplateDef,
    /// The element type the kernel is specialised for (`{{dtype}}` in the template).
    pub dtype: DType,
    /// Threads per block the kernel is written for (`{{block_dim}}`), at least 1.
    pub block_dim: u16,
    /// Elements each thread reads per step (a 16-byte vector is `dtype.vec_width()`).
    pub n_reads: u8,
    /// Values of the family's named constants, in `template.const_names` order; unused slots 0.
    pub consts: [i32; MAX_CONSTS],
}

impl KernelSpec {
    /// The value of the family's constant `name`, if the family declares one by that name.
    pub fn constant(&self, name: &str) -> Option<i32> {
        let i = self.template.const_names.iter().position(|n| *n == name)?;
        self.consts.get(i).copied()
    }

    /// Whether the family can be built for architecture `arch` (compute capability x 10).
    pub fn builds_for(&self, arch: u32) -> bool {
        self.template.only_arch.map_or(true, |a| a == arch)
    }

    /// A spec of `template`, with one value per name in `template.const_names`, in that
    /// order. A wrong number of values is an error naming the template's constants; a family
    /// whose name another family already has is an error too (the first use registers it).
    pub fn try_new(
        template: &'static TemplateDef,
        dtype: DType,
        block_dim: u16,
        n_reads: u8,
        consts: &[i32],
    ) -> Result<KernelSpec> {
        super::family::claim(template)?;
        Self::build(template, dtype, block_dim, n_reads, consts)
    }

    /// The checks of `try_new` but the registry's (kiln's families are registered from their
    /// specs, so building those must not consult the registry).
    fn build(
        template: &'static TemplateDef,
        dtype: DType,
        block_dim: u16,
        n_reads: u8,
        consts: &[i32],
    ) -> Result<KernelSpec> {
        if block_dim == 0 || n_reads == 0 {
            return Err(Error::InvalidArgument {
                arg: "spec",
                reason: format!(
                    "{}: block_dim ({block_dim}) and n_reads ({n_reads}) must be at least 1",
                    template.name
                ),
            });
        }
        if template.const_names.len() > MAX_CONSTS {
            return Err(Error::InvalidArgument {
                arg: "template",
                reason: format!(
                    "{} names {} constants; a spec holds at most {MAX_CONSTS}",
                    template.name,
                    template.const_names.len()
                ),
            });
        }
        if consts.len() != template.const_names.len() {
            return Err(Error::InvalidArgument {
                arg: "consts",
                reason: format!(
                    "{} takes {} constants {:?}, got {}",
                    template.name,
                    template.const_names.len(),
                    template.const_names,
                    consts.len()
                ),
            });
        }
        let mut values = [0; MAX_CONSTS];
        values[..consts.len()].copy_from_slice(consts);
        Ok(KernelSpec {
            template,
            dtype,
            block_dim,
            n_reads,
            consts: values,
        })
    }

    /// [`KernelSpec::try_new`] for kiln's own families, whose constant lists are written next
    /// to their templates and checked by the spec tests: a mismatch there is a bug in kiln.
    pub(crate) fn new(
        template: &'static TemplateDef,
        dtype: DType,
        block_dim: u16,
        n_reads: u8,
        consts: &[i32],
    ) -> KernelSpec {
        match Self::build(template, dtype, block_dim, n_reads, consts) {
            Ok(spec) => spec,
            Err(e) => unreachable!("{e}"),
        }
    }

    /// (name, value) of each named constant.
    pub fn named_consts(&self) -> impl Iterator<Item = (&'static str, i32)> + '_ {
        self.template
            .const_names
            .iter()
            .copied()
            .zip(self.consts.iter().copied())
    }
}

impl fmt::Display for KernelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} block={} n_reads={}",
            self.template.name, self.dtype, self.block_dim, self.n_reads
        )?;
        for (name, value) in self.named_consts() {
            write!(f, " {name}={value}")?;
        }
        Ok(())
    }
}
