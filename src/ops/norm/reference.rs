//! f64 CPU references of the forward and the VJP, for tests and benches.

use super::*;

/// The f64 CPU reference of the forward pass: `x` row-major `rows x d`.
#[doc(hidden)]
pub fn reference_forward(
    kind: Kind,
    x: &[f64],
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    d: usize,
    eps: f64,
) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(d.max(1)) {
        let (mean, rstd) = stats(kind, row, eps);
        for (j, v) in row.iter().enumerate() {
            let mut o = (v - mean) * rstd * w.map_or(1.0, |w| w[j]);
            if kind == Kind::LayerNorm {
                o += b.map_or(0.0, |b| b[j]);
            }
            y.push(o);
        }
    }
    y
}

pub(super) fn stats(kind: Kind, row: &[f64], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = match kind {
        Kind::LayerNorm => row.iter().sum::<f64>() / n,
        Kind::RmsNorm => 0.0,
    };
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// The f64 CPU reference of the VJP: (dx, dweight, dbias) for cotangent `g`.
#[doc(hidden)]
pub fn reference_vjp(
    kind: Kind,
    x: &[f64],
    w: Option<&[f64]>,
    g: &[f64],
    d: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut dx = Vec::with_capacity(x.len());
    let (mut dw, mut db) = (vec![0.0; d], vec![0.0; d]);
    for (row, grow) in x.chunks(d.max(1)).zip(g.chunks(d.max(1))) {
        let (mean, rstd) = stats(kind, row, eps);
        let n = d as f64;
        let xh: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
        let wg: Vec<f64> = grow
            .iter()
            .enumerate()
            .map(|(j, g)| g * w.map_or(1.0, |w| w[j]))
            .collect();
        let c1 = wg.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / n;
        let c2 = match kind {
            Kind::LayerNorm => wg.iter().sum::<f64>() / n,
            Kind::RmsNorm => 0.0,
        };
        for j in 0..d {
            dx.push(rstd * (wg[j] - c2 - xh[j] * c1));
            dw[j] += grow[j] * xh[j];
            db[j] += grow[j];
        }
    }
    (dx, dw, db)
}
