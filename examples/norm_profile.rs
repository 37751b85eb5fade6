//! A small program for profilers (ncu, compute-sanitizer): LayerNorm forward in f32 and bf16
//! and the bf16 VJP on 16384x768, twice each. Usage: cargo run --release --example norm_profile
use kiln::ops::norm;
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::DType;

fn main() -> kiln::Result<()> {
    let dev = Device::get(0)?;
    let mut enc = CommandEncoder::new(&dev)?;
    let (rows, d) = (16384, 768);
    let mut rng = TestRng::new(1);
    for dtype in [DType::F32, DType::BF16] {
        let x = Array::from_f64(&mut enc, dtype, &rng.values(rows * d, 2.0, 0.0), &[rows, d])?;
        let g = Array::from_f64(&mut enc, dtype, &rng.values(rows * d, 1.0, 0.0), &[rows, d])?;
        let w = Array::from_f64(&mut enc, dtype, &rng.values(d, 1.0, 1.0), &[d])?;
        for _ in 0..2 {
            norm::layer_norm(&mut enc, &x, Some(&w), Some(&w), 1e-5)?;
            if dtype == DType::BF16 {
                norm::layer_norm_vjp(&mut enc, &x, Some(&w), Some(&w), &g, 1e-5)?;
            }
        }
        enc.synchronize()?;
    }
    println!("done");
    Ok(())
}
