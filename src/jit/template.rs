//! Rendering a [`KernelSpec`] into CUDA source with handlebars.
//!
//! Templates and partials are embedded in the library; each is parsed once per process and kept in
//! one registry. Rendering happens only on a kernel-table miss.

use std::sync::{OnceLock, RwLock};

use handlebars::Handlebars;
use serde_json::{Map, Value};

use super::spec::KernelSpec;
use crate::error::{Error, Result};

/// Partials every template can use, as `{{> name}}`.
pub const PARTIALS: &[(&str, &str)] = &[
    ("prelude", include_str!("../../templates/prelude.cuh")),
    ("norm", include_str!("../../templates/norm.cuh")),
    ("tma", include_str!("../../templates/tma.cuh")),
    ("cluster", include_str!("../../templates/cluster.cuh")),
];

/// CUDA source for one spec, ready for NVRTC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub source: String,
    /// The expressions NVRTC resolves to lowered (mangled) names.
    pub name_expressions: Vec<String>,
}

fn registry() -> &'static RwLock<Handlebars<'static>> {
    static REGISTRY: OnceLock<RwLock<Handlebars<'static>>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut hb = Handlebars::new();
        // CUDA is not HTML: `<` and `&` must come through as written.
        hb.register_escape_fn(handlebars::no_escape);
        // A misspelt variable is an error, not an empty string.
        hb.set_strict_mode(true);
        for (name, text) in PARTIALS {
            hb.register_partial(name, *text)
                .expect("embedded partials parse (checked by tests)");
        }
        RwLock::new(hb)
    })
}

/// The values a template sees: `dtype` (device type), `dtype_name`, `block_dim`, `n_reads`,
/// `kernel`, and each named constant.
fn context(spec: &KernelSpec) -> Value {
    let mut m = Map::new();
    m.insert("dtype".into(), spec.dtype.cuda_type().into());
    m.insert("dtype_name".into(), spec.dtype.name().into());
    m.insert("block_dim".into(), spec.block_dim.into());
    m.insert("n_reads".into(), spec.n_reads.into());
    m.insert("kernel".into(), spec.template.kernel.into());
    for (name, value) in spec.named_consts() {
        m.insert(name.into(), value.into());
    }
    Value::Object(m)
}

pub fn render(spec: &KernelSpec) -> Result<Rendered> {
    let def = spec.template;
    let template_error = |e: &dyn std::fmt::Display| Error::Template {
        template: def.name.to_string(),
        message: e.to_string(),
    };
    let lock = registry();
    if !lock
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .has_template(def.name)
    {
        let mut hb = lock.write().unwrap_or_else(|e| e.into_inner());
        if !hb.has_template(def.name) {
            hb.register_template_string(def.name, def.source)
                .map_err(|e| template_error(&e))?;
        }
    }
    let hb = lock.read().unwrap_or_else(|e| e.into_inner());
    let source = hb
        .render(def.name, &context(spec))
        .map_err(|e| template_error(&e))?;
    Ok(Rendered {
        source,
        name_expressions: vec![def.kernel.to_string()],
    })
}
