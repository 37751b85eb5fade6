//! The f64 CPU reference for all three passes, written from the definition: every (output pixel,
//! kernel tap) pair that reads a real input pixel contributes x * w to the output, the cotangent
//! times w to the input gradient and the cotangent times x to the weight gradient.
//!
//! Each result comes with the sum of |terms| per element, which bounds the rounding error of any
//! summation order (tests scale their tolerance by it).

use super::geometry::Geometry;

/// Result values and the sum of the absolute values of their terms.
pub struct Reference {
    pub values: Vec<f64>,
    pub magnitude: Vec<f64>,
}

/// Calls `f(batch, output pixel, input pixel, weight tap)` for every pair that reads a real input
/// pixel. Pixels are flat indices in their (d, h, w) extents; the tap is already flipped when the
/// convolution flips.
fn for_each_tap(g: &Geometry, mut f: impl FnMut(usize, usize, usize, usize)) {
    let [od, oh, ow] = g.output;
    let [_, kh, kw] = g.kernel;
    let ks = g.kernel_size();
    for b in 0..g.batch {
        for o in 0..od * oh * ow {
            let opos = [o / (oh * ow), (o / ow) % oh, o % ow];
            'tap: for t in 0..ks {
                let kpos = [t / (kh * kw), (t / kw) % kh, t % kw];
                let mut ipix = 0;
                for d in 0..3 {
                    // Position in the dilated, padded input, then in the real one.
                    let q = (opos[d] * g.stride[d] + kpos[d] * g.kernel_dilation[d]) as isize
                        - g.pad_lo[d] as isize;
                    let dil = g.input_dilation[d] as isize;
                    if q < 0 || q % dil != 0 || q / dil >= g.input[d] as isize {
                        continue 'tap;
                    }
                    ipix = ipix * g.input[d] + (q / dil) as usize;
                }
                let tap = if g.flip { ks - 1 - t } else { t };
                f(b, o, ipix, tap);
            }
        }
    }
}

fn accumulate(
    g: &Geometry,
    out_len: usize,
    mut visit: impl FnMut(usize, usize, usize, usize, &mut dyn FnMut(usize, f64)),
) -> Reference {
    let mut values = vec![0.0; out_len];
    let mut magnitude = vec![0.0; out_len];
    for_each_tap(g, |b, o, i, t| {
        visit(b, o, i, t, &mut |idx, term| {
            values[idx] += term;
            magnitude[idx] += term.abs();
        })
    });
    Reference { values, magnitude }
}

/// `y = conv(x, w)`: x is (N, spatial..., C_in), w is (C_out, spatial..., C_in / groups).
pub fn forward(g: &Geometry, x: &[f64], w: &[f64]) -> Reference {
    let (cin_g, cout_g, ks) = (g.cin / g.groups, g.cout / g.groups, g.kernel_size());
    let (ip, op) = (g.input_pixels(), g.output_pixels());
    accumulate(g, g.batch * op * g.cout, |b, o, i, t, add| {
        for grp in 0..g.groups {
            for co in grp * cout_g..(grp + 1) * cout_g {
                for c in 0..cin_g {
                    add(
                        (b * op + o) * g.cout + co,
                        x[(b * ip + i) * g.cin + grp * cin_g + c] * w[(co * ks + t) * cin_g + c],
                    );
                }
            }
        }
    })
}

/// The input gradient: dx[b, i, c] = sum over (o, tap) reading i of dy[b, o, co] * w[co, tap, c].
pub fn backward_data(g: &Geometry, dy: &[f64], w: &[f64]) -> Reference {
    let (cin_g, cout_g, ks) = (g.cin / g.groups, g.cout / g.groups, g.kernel_size());
    let (ip, op) = (g.input_pixels(), g.output_pixels());
    accumulate(g, g.batch * ip * g.cin, |b, o, i, t, add| {
        for grp in 0..g.groups {
            for co in grp * cout_g..(grp + 1) * cout_g {
                let gy = dy[(b * op + o) * g.cout + co];
                for c in 0..cin_g {
                    add(
                        (b * ip + i) * g.cin + grp * cin_g + c,
                        gy * w[(co * ks + t) * cin_g + c],
                    );
                }
            }
        }
    })
}

/// The weight gradient: dw[co, tap, c] = sum over (b, o) of dy[b, o, co] * x[b, i(o, tap), c].
pub fn backward_weight(g: &Geometry, x: &[f64], dy: &[f64]) -> Reference {
    let (cin_g, cout_g, ks) = (g.cin / g.groups, g.cout / g.groups, g.kernel_size());
    let (ip, op) = (g.input_pixels(), g.output_pixels());
    accumulate(g, g.cout * ks * cin_g, |b, o, i, t, add| {
        for grp in 0..g.groups {
            for co in grp * cout_g..(grp + 1) * cout_g {
                let gy = dy[(b * op + o) * g.cout + co];
                for c in 0..cin_g {
                    add(
                        (co * ks + t) * cin_g + c,
                        gy * x[(b * ip + i) * g.cin + grp * cin_g + c],
                    );
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::conv::ConvParams;

    fn geometry(x: &[usize], w: &[usize], p: &ConvParams) -> Geometry {
        Geometry::new(x, w, p).unwrap()
    }

    #[test]
    fn one_dim_by_hand() {
        // x = [1, 2, 3, 4], w = [1, 10], stride 1: cross-correlation [21, 32, 43];
        // flipped: [12, 23, 34].
        let x = [1.0, 2.0, 3.0, 4.0];
        let w = [1.0, 10.0];
        let g = geometry(&[1, 4, 1], &[1, 2, 1], &ConvParams::default());
        assert_eq!(forward(&g, &x, &w).values, vec![21.0, 32.0, 43.0]);
        let gf = geometry(&[1, 4, 1], &[1, 2, 1], &ConvParams::default().flip(true));
        assert_eq!(forward(&gf, &x, &w).values, vec![12.0, 23.0, 34.0]);
        // Input dilation 2 and padding 1: the dilated, padded input is [0, 1, 0, 2, 0, 3, 0, 4, 0].
        let gd = geometry(
            &[1, 4, 1],
            &[1, 2, 1],
            &ConvParams::default().input_dilation(&[2]).padding(&[1]),
        );
        assert_eq!(
            forward(&gd, &x, &w).values,
            vec![10.0, 1.0, 20.0, 2.0, 30.0, 3.0, 40.0, 4.0]
        );
    }

    /// <conv(x, w), dy> = <x, dx(dy)> = <w, dw(x, dy)>: the three passes are adjoint.
    #[test]
    fn passes_are_adjoint() {
        let cases = [
            (
                vec![2, 7, 6, 4],
                vec![6, 3, 2, 2],
                ConvParams::default().groups(2),
            ),
            (
                vec![1, 9, 5],
                vec![3, 3, 5],
                ConvParams::default()
                    .strides(&[2])
                    .padding_lo(&[2])
                    .padding_hi(&[1])
                    .kernel_dilation(&[2])
                    .input_dilation(&[2])
                    .flip(true),
            ),
            (
                vec![1, 3, 4, 3, 2],
                vec![2, 2, 3, 2, 2],
                ConvParams::default()
                    .strides(&[1, 2, 3])
                    .padding(&[1, 0, 2]),
            ),
        ];
        for (xs, ws, p) in cases {
            let g = geometry(&xs, &ws, &p);
            let fill = |n: usize, seed: f64| -> Vec<f64> {
                (0..n).map(|i| ((i as f64 + seed) * 0.7).sin()).collect()
            };
            let x = fill(xs.iter().product(), 0.3);
            let w = fill(ws.iter().product(), 1.1);
            let dy = fill(g.output_shape().iter().product(), 2.9);
            let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f64>();
            let y = forward(&g, &x, &w).values;
            let dx = backward_data(&g, &dy, &w).values;
            let dw = backward_weight(&g, &x, &dy).values;
            let (a, b, c) = (dot(&y, &dy), dot(&x, &dx), dot(&w, &dw));
            assert!(
                (a - b).abs() < 1e-9 * (1.0 + a.abs()),
                "{a} vs {b} for {g:?}"
            );
            assert!(
                (a - c).abs() < 1e-9 * (1.0 + a.abs()),
                "{a} vs {c} for {g:?}"
            );
            assert!(a.abs() > 1e-3, "a degenerate case proves nothing: {g:?}");
        }
    }
}
