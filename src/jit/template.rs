//! Rendering a [`KernelSpec`] into CUDA source with handlebars.
//!
//! Templates and partials are embedded in the library (or given by an application's family);
//! each family's is parsed once per process and kept in its own registry. Rendering happens only
//! on a kernel-table miss.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

use handlebars::Handlebars;
use serde_json::{Map, Value};

use super::family;
use super::spec::{KernelSpec, TemplateDef};
use crate::error::{Error, Result};

/// Partials every template can use, as `{{> name}}`.
pub const PARTIALS: &[(&str, &str)] = &[
    ("prelude", include_str!("../../templates/prelude.cuh")),
    ("norm", include_str!("../../templates/norm.cuh")),
    ("tma", include_str!("../../templates/tma.cuh")),
    ("cluster", include_str!("../../templates/cluster.cuh")),
    ("bulk", include_str!("../../templates/bulk.cuh")),
    ("mma", include_str!("../../templates/mma.cuh")),
    ("depthwise", include_str!("../../templates/depthwise.cuh")),
];

/// CUDA source for one spec, ready for NVRTC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub source: String,
    /// The expressions NVRTC resolves to lowered (mangled) names.
    pub name_expressions: Vec<String>,
}

/// One handlebars registry per family (keyed by the family's address): kiln's partials, the
/// family's own partials and its template. Separate registries mean one family's text or
/// partials can never be served for another's, whatever the names.
fn family_registry(def: &'static TemplateDef) -> Result<Arc<Handlebars<'static>>> {
    static REGISTRIES: OnceLock<RwLock<HashMap<usize, Arc<Handlebars<'static>>>>> = OnceLock::new();
    let lock = REGISTRIES.get_or_init(Default::default);
    let id = def as *const TemplateDef as usize;
    if let Some(hb) = lock.read().unwrap_or_else(|e| e.into_inner()).get(&id) {
        return Ok(hb.clone());
    }
    let template_error = |e: &dyn std::fmt::Display| Error::Template {
        template: def.name.to_string(),
        message: e.to_string(),
    };
    let extras = family::extras(def)?;
    let mut hb = Handlebars::new();
    // CUDA is not HTML: `<` and `&` must come through as written.
    hb.register_escape_fn(handlebars::no_escape);
    // A misspelt variable is an error, not an empty string.
    hb.set_strict_mode(true);
    for (name, text) in PARTIALS.iter().chain(extras.partials) {
        hb.register_partial(name, *text)
            .map_err(|e| template_error(&format!("partial {name}: {e}")))?;
    }
    hb.register_template_string(def.name, def.source)
        .map_err(|e| template_error(&e))?;
    let hb = Arc::new(hb);
    let mut map = lock.write().unwrap_or_else(|e| e.into_inner());
    Ok(map.entry(id).or_insert(hb).clone())
}

/// The values every template sees besides its named constants, which may not take these names.
pub const CONTEXT: [&str; 5] = ["dtype", "dtype_name", "block_dim", "n_reads", "kernel"];

/// The values a template sees: [`CONTEXT`] (`dtype` is the device type), and each named
/// constant.
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
    let hb = family_registry(def)?;
    let source = hb
        .render(def.name, &context(spec))
        .map_err(|e| Error::Template {
            template: def.name.to_string(),
            message: e.to_string(),
        })?;
    let mut name_expressions = vec![def.kernel.to_string()];
    name_expressions.extend(
        family::extras(def)?
            .entry_points
            .iter()
            .map(|e| e.to_string()),
    );
    Ok(Rendered {
        source,
        name_expressions,
    })
}
