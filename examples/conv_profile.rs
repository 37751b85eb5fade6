//! A small program for profilers (ncu, compute-sanitizer): one convolution pass, run twice.
//! Usage: conv_profile N,C,H,W,K,R,S,stride,pad[,groups] f16|bf16|f32
//! forward|backward_data|backward_weight [BMxBN[s][p]/SPLITS]
//! (default: 32,128,28,28,128,3,3,1,1 f16 forward). The last argument runs the Hopper family
//! with that tile (`s`: swapped, `p`: paired in clusters of two) and split instead of the plan's
//! choice.
use kiln::ops::conv::{self, hopper, tuning, ConvParams, Geometry, Pass};
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::{DType, Error};

fn bad(arg: &'static str, reason: &str) -> Error {
    Error::InvalidArgument {
        arg,
        reason: reason.into(),
    }
}

fn main() -> kiln::Result<()> {
    let mut args = std::env::args().skip(1);
    let shape: Vec<usize> = args
        .next()
        .unwrap_or("32,128,28,28,128,3,3,1,1".into())
        .split(',')
        .map(|v| v.parse().map_err(|_| bad("shape", v)))
        .collect::<kiln::Result<_>>()?;
    let (n, c, h, w, k, r, s, stride, pad, groups) = match shape[..] {
        [n, c, h, w, k, r, s, stride, pad] => (n, c, h, w, k, r, s, stride, pad, 1),
        [n, c, h, w, k, r, s, stride, pad, g] => (n, c, h, w, k, r, s, stride, pad, g),
        _ => return Err(bad("shape", "needs N,C,H,W,K,R,S,stride,pad[,groups]")),
    };
    let dtype: DType = match args.next().as_deref().unwrap_or("f16") {
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        other => return Err(bad("dtype", other)),
    };
    let pass = match args.next().as_deref().unwrap_or("forward") {
        "forward" => Pass::Forward,
        "backward_data" => Pass::BackwardData,
        "backward_weight" => Pass::BackwardWeight,
        other => return Err(bad("pass", other)),
    };
    let hopper_tile = match args.next() {
        None => None,
        Some(t) => Some(parse_tile(&t).ok_or_else(|| bad("tile", &t))?),
    };
    let p = ConvParams::default()
        .strides(&[stride])
        .padding(&[pad])
        .groups(groups);
    let g = Geometry::new(&[n, h, w, c], &[k, r, s, c / groups.max(1)], &p)?;
    let dev = Device::get(0)?;
    let mut enc = CommandEncoder::new(&dev)?;
    let mut rng = TestRng::new(1);
    let mut up = |enc: &mut CommandEncoder, shape: &[usize]| {
        let len = shape.iter().product();
        Array::from_f64(enc, dtype, &rng.values(len, 2.0, 0.0), shape)
    };
    let x = up(&mut enc, &g.input_shape())?;
    let wt = up(&mut enc, &g.weight_shape())?;
    let dy = up(&mut enc, &g.output_shape())?;
    let (first, second) = match pass {
        Pass::Forward => (&x, &wt),
        Pass::BackwardData => (&dy, &wt),
        Pass::BackwardWeight => (&x, &dy),
    };
    for _ in 0..2 {
        match hopper_tile {
            None => conv::conv_pass(&mut enc, pass, &p, &x, &wt, &dy)?,
            Some((tile, splits)) => {
                tuning::run_hopper_with(&mut enc, pass, &g, first, second, tile, splits)?
            }
        };
    }
    enc.synchronize()?;
    // The device outlives main (a process-wide handle): hand its cached blocks back to the
    // driver, so that compute-sanitizer's leak check reports only memory kiln lost.
    drop((x, wt, dy, enc));
    dev.allocator().release_cache()?;
    println!("done");
    Ok(())
}

/// "128x320s/3": a Hopper tile (`s`: swapped, `p`: paired in clusters of two, as in "128x320sp")
/// and a split.
fn parse_tile(text: &str) -> Option<(hopper::Tile, usize)> {
    let (tile, splits) = text.split_once('/')?;
    let paired = tile.ends_with('p');
    let tile = tile.trim_end_matches('p');
    let swapped = tile.ends_with('s');
    let (bm, bn) = tile.trim_end_matches('s').split_once('x')?;
    let tile = hopper::Tile {
        bm: bm.parse().ok()?,
        bn: bn.parse().ok()?,
        swapped,
        cluster: if paired { 2 } else { 1 },
    };
    Some((tile, splits.parse().ok()?))
}
