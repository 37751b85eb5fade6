//! A small program for profilers (ncu, compute-sanitizer): runs norm ops twice each.
//! Usage: cargo run --release --example norm_profile [DTYPE OP ROWS D]...
//! with OP one of layer_norm, rms_norm, layer_norm_vjp, rms_norm_vjp; default: bf16 layer_norm_vjp 16384 768.
use kiln::ops::norm;
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::DType;

fn main() -> kiln::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        args = ["bf16", "layer_norm_vjp", "16384", "768"]
            .map(String::from)
            .to_vec();
    }
    let dev = Device::get(0)?;
    let mut enc = CommandEncoder::new(&dev)?;
    let mut rng = TestRng::new(1);
    for case in args.chunks(4) {
        let [dtype, op, rows, d] = case else {
            panic!("arguments come in fours: DTYPE OP ROWS D");
        };
        let dtype = DType::ALL
            .into_iter()
            .find(|t| t.name() == dtype)
            .expect("dtype: f32, f16 or bf16");
        let (rows, d): (usize, usize) = (rows.parse().expect("ROWS"), d.parse().expect("D"));
        let x = Array::from_f64(&mut enc, dtype, &rng.values(rows * d, 2.0, 0.0), &[rows, d])?;
        let g = Array::from_f64(&mut enc, dtype, &rng.values(rows * d, 1.0, 0.0), &[rows, d])?;
        let w = Array::from_f64(&mut enc, dtype, &rng.values(d, 1.0, 1.0), &[d])?;
        for _ in 0..2 {
            match op.as_str() {
                "layer_norm" => drop(norm::layer_norm(&mut enc, &x, Some(&w), Some(&w), 1e-5)?),
                "rms_norm" => drop(norm::rms_norm(&mut enc, &x, Some(&w), 1e-5)?),
                "layer_norm_vjp" => drop(norm::layer_norm_vjp(
                    &mut enc,
                    &x,
                    Some(&w),
                    Some(&w),
                    &g,
                    1e-5,
                )?),
                "rms_norm_vjp" => drop(norm::rms_norm_vjp(&mut enc, &x, Some(&w), &g, 1e-5)?),
                other => panic!("unknown op {other}"),
            }
        }
        enc.synchronize()?;
    }
    // The device outlives main (a process-wide handle): hand its cached blocks back to the
    // driver, so that compute-sanitizer's leak check reports only memory kiln lost.
    drop(enc);
    dev.allocator().release_cache()?;
    println!("done");
    Ok(())
}
