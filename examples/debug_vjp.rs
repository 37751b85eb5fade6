use kiln::ops::norm::{self, Kind};
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::DType;

fn main() {
    let dev = Device::get(0).unwrap();
    let mut enc = CommandEncoder::new(&dev).unwrap();
    let (rows, d) = (4usize, 1000usize);
    let mut rng = TestRng::new(3);
    let x = rng.values(rows * d, 2.0, 0.5);
    let w = rng.values(d, 1.0, 1.0);
    let g = rng.values(rows * d, 1.0, 0.0);
    let xa = Array::from_f64(&mut enc, DType::F32, &x, &[rows, d]).unwrap();
    let wa = Array::from_f64(&mut enc, DType::F32, &w, &[d]).unwrap();
    let ga = Array::from_f64(&mut enc, DType::F32, &g, &[rows, d]).unwrap();
    let (_, rdw, rdb) = norm::reference_vjp(Kind::LayerNorm, &x, Some(&w), &g, d, 1e-5);
    let (_, dw, db) = norm::layer_norm_vjp(&mut enc, &xa, Some(&wa), Some(&wa), &ga, 1e-5).unwrap();
    let dw = dw.unwrap().to_f64(&mut enc).unwrap();
    let db = db.unwrap().to_f64(&mut enc).unwrap();
    println!("dw[0..4] gpu {:?}\n          ref {:?}", &dw[..4], &rdw[..4]);
    println!("db[0..4] gpu {:?}\n          ref {:?}", &db[..4], &rdb[..4]);
    // The reduce alone on known data.
    for prow in [1usize, 3, 40, 300] {
        let p: Vec<f64> = (0..prow * 70).map(|i| (i % 7) as f64).collect();
        let pa = Array::from_f64(&mut enc, DType::F32, &p, &[prow, 70]).unwrap();
        let out = norm::reduce_cols(&mut enc, &pa, DType::F32)
            .unwrap()
            .to_f64(&mut enc)
            .unwrap();
        let want: Vec<f64> = (0..70)
            .map(|c| (0..prow).map(|r| p[r * 70 + c]).sum())
            .collect();
        println!(
            "reduce rows={prow}: ok={} gpu[0..3]={:?} want={:?}",
            out == want,
            &out[..3],
            &want[..3]
        );
    }
}
