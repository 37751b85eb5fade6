//! The registry of kernel families: one name, one family, per process.
//!
//! A family's identity is its `&'static TemplateDef` (its address). Names are what people read
//! and what handlebars once keyed templates by, so two families may not share one: kiln's own
//! families are registered when the registry is first used, and an application's family is
//! registered by [`register_family`] (or implicitly, with no extras, by
//! [`KernelSpec::try_new`](super::KernelSpec::try_new) and on its first render). A second
//! family under a taken name is an error, never a silent substitution.

use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};

use super::spec::TemplateDef;
use super::template::PARTIALS;
use crate::error::{Error, Result};

/// What an application family may add to its template: its own partials, more entry points and
/// NVRTC options. kiln's families use none of these, but for its stand-ins' options
/// (`ops::STAND_IN_EXTRAS`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FamilyExtras {
    /// Partials only this family's template sees, as (name, text), used as `{{> name}}` beside
    /// kiln's (`prelude`, `norm`, `tma`, `cluster`, `bulk`), whose names they may not take.
    pub partials: &'static [(&'static str, &'static str)],
    /// `__global__` functions the module exposes besides `TemplateDef::kernel` (NVRTC name
    /// expressions; `extern "C"` names or C++ expressions such as `my_kernel<float>`).
    pub entry_points: &'static [&'static str],
    /// NVRTC options added after kiln's (`-DNAME=1`, `-lineinfo`, `--maxrregcount=64`, ...).
    /// Options that choose the target or the language standard are kiln's and refused here.
    pub options: &'static [&'static str],
}

impl FamilyExtras {
    /// Nothing added: what kiln's own families and implicitly registered ones have.
    pub const NONE: FamilyExtras = FamilyExtras {
        partials: &[],
        entry_points: &[],
        options: &[],
    };
}

#[derive(Clone, Copy)]
struct Registered {
    def: &'static TemplateDef,
    extras: FamilyExtras,
}

fn registry() -> &'static RwLock<HashMap<&'static str, Registered>> {
    static REGISTRY: OnceLock<RwLock<HashMap<&'static str, Registered>>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut map = HashMap::new();
        for def in crate::ops::kiln_families() {
            let stand_in = crate::ops::STAND_IN_FAMILIES
                .iter()
                .any(|s| std::ptr::eq(*s, *def));
            let extras = if stand_in {
                crate::ops::STAND_IN_EXTRAS
            } else {
                FamilyExtras::NONE
            };
            map.insert(def.name, Registered { def, extras });
        }
        RwLock::new(map)
    })
}

fn clash(def: &TemplateDef, other: &TemplateDef) -> Error {
    let owner = if crate::ops::kiln_families()
        .iter()
        .any(|k| std::ptr::eq(*k, other))
    {
        "one of kiln's own families"
    } else {
        "another family registered in this process"
    };
    Error::InvalidArgument {
        arg: "template",
        reason: format!(
            "a kernel family named {:?} already exists ({owner}); family names must be unique, \
             so give this one a prefix of its own (e.g. \"myapp_{}\")",
            def.name, def.name
        ),
    }
}

/// Registers an application family with its extras. Registering the same family again with the
/// same extras is a no-op; a different family under the same name, or the same family with
/// different extras, is an error.
pub fn register_family(def: &'static TemplateDef, extras: FamilyExtras) -> Result<()> {
    validate(def, &extras)?;
    let mut map = registry().write().unwrap_or_else(|e| e.into_inner());
    match map.get(def.name) {
        Some(r) if !std::ptr::eq(r.def, def) => Err(clash(def, r.def)),
        Some(r) if r.extras != extras => Err(Error::InvalidArgument {
            arg: "extras",
            reason: format!(
                "family {:?} is already registered with other extras (register it once, before \
                 making its specs)",
                def.name
            ),
        }),
        Some(_) => Ok(()),
        None => {
            map.insert(def.name, Registered { def, extras });
            Ok(())
        }
    }
}

/// Claims `def`'s name for it (registering it with no extras if it is new); an error when the
/// name belongs to another family. The usual case is one read lock.
pub fn claim(def: &'static TemplateDef) -> Result<()> {
    if let Some(r) = registry()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(def.name)
    {
        return if std::ptr::eq(r.def, def) {
            Ok(())
        } else {
            Err(clash(def, r.def))
        };
    }
    register_family(def, FamilyExtras::NONE)
}

/// The extras `def` was registered with (claiming it first).
pub fn extras(def: &'static TemplateDef) -> Result<FamilyExtras> {
    claim(def)?;
    let map = registry().read().unwrap_or_else(|e| e.into_inner());
    Ok(map.get(def.name).map_or(FamilyExtras::NONE, |r| r.extras))
}

fn validate(def: &TemplateDef, extras: &FamilyExtras) -> Result<()> {
    let bad = |arg: &'static str, reason: String| Err(Error::InvalidArgument { arg, reason });
    let plain = |s: &str| !s.is_empty() && !s.contains(char::is_whitespace);
    if !plain(def.name) || !plain(def.kernel) {
        return bad(
            "template",
            format!(
                "family name {:?} and kernel {:?} must be non-empty, without spaces",
                def.name, def.kernel
            ),
        );
    }
    // The template sees the constants beside these values, in one namespace: a constant named
    // like one of them, or like an earlier constant, would replace it without a word.
    let context = super::template::CONTEXT;
    for (i, c) in def.const_names.iter().enumerate() {
        if !plain(c) || context.contains(c) || def.const_names[..i].contains(c) {
            return bad(
                "template.const_names",
                format!(
                    "{c:?} is empty, has spaces, repeats an earlier constant or takes the name of \
                     a value every template sees ({context:?})"
                ),
            );
        }
    }
    for (name, _) in extras.partials {
        if !plain(name) || PARTIALS.iter().any(|(k, _)| k == name) {
            return bad(
                "extras.partials",
                format!("{name:?} is empty, has spaces or is one of kiln's partials"),
            );
        }
    }
    for e in extras.entry_points {
        if e.trim().is_empty() || *e == def.kernel {
            return bad(
                "extras.entry_points",
                format!("{e:?} is empty or repeats the family's kernel"),
            );
        }
    }
    for o in extras.options {
        let reserved = ["--gpu-architecture", "-arch", "--std", "-std"];
        if o.trim().is_empty() || reserved.iter().any(|r| o.starts_with(r)) {
            return bad(
                "extras.options",
                format!(
                    "{o:?}: the target and the C++ standard are chosen by kiln (--std=c++17, \
                     the target from the device or `kiln warm --arch`)"
                ),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    static SHADOWS_BLOCK_DIM: TemplateDef = TemplateDef {
        name: "test_shadows_block_dim",
        source: "{{block_dim}}",
        kernel: "test_shadows_block_dim",
        const_names: &["block_dim"],
        arch_specific: false,
        only_arch: None,
    };

    static REPEATS_A_CONSTANT: TemplateDef = TemplateDef {
        name: "test_repeats_a_constant",
        source: "{{N}}",
        kernel: "test_repeats_a_constant",
        const_names: &["N", "M", "N"],
        arch_specific: false,
        only_arch: None,
    };

    #[test]
    fn constants_that_would_replace_another_value_are_refused() {
        // Rendered, `block_dim` was the constant's value while the launch used the spec's
        // block_dim; and `N` the second value while `KernelSpec::constant("N")` read the first.
        for def in [&SHADOWS_BLOCK_DIM, &REPEATS_A_CONSTANT] {
            let err = register_family(def, FamilyExtras::NONE).unwrap_err();
            assert_eq!(err.argument(), Some("template.const_names"), "{err}");
            let err = crate::jit::KernelSpec::try_new(
                def,
                crate::DType::F32,
                32,
                1,
                &[1, 2, 3][..def.const_names.len()],
            )
            .unwrap_err();
            assert_eq!(err.argument(), Some("template.const_names"), "{err}");
        }
    }
}
