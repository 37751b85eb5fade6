//! A training-like step shared by the encoder-bounds test and the loop bench: bf16 convolution
//! forward (8x32x32x64, 3x3, padding 1), LayerNorm over the channels, its VJP, then the
//! convolution's backward-data and backward-weight passes.

use kiln::ops::conv::{conv_backward_data, conv_backward_weight, conv_forward, ConvParams};
use kiln::ops::norm::{layer_norm, layer_norm_vjp};
use kiln::runtime::{Array, CommandEncoder};
use kiln::selfcheck::TestRng;
use kiln::DType;

pub const X_SHAPE: [usize; 4] = [8, 32, 32, 64];
pub const W_SHAPE: [usize; 4] = [64, 3, 3, 64];

/// The step's fixed inputs: input, conv weight, norm weight and bias.
pub struct Model {
    pub x: Array,
    pub w: Array,
    pub gamma: Array,
    pub beta: Array,
    pub params: ConvParams,
}

impl Model {
    pub fn new(enc: &mut CommandEncoder, seed: u64) -> Model {
        let mut rng = TestRng::new(seed);
        let mut upload = |shape: &[usize], scale: f64, mean: f64| {
            let n = shape.iter().product();
            Array::from_f64(enc, DType::BF16, &rng.values(n, scale, mean), shape).unwrap()
        };
        Model {
            x: upload(&X_SHAPE, 1.0, 0.0),
            w: upload(&W_SHAPE, 0.05, 0.0),
            gamma: upload(&[64], 0.2, 1.0),
            beta: upload(&[64], 0.2, 0.0),
            params: ConvParams::default().padding(&[1]),
        }
    }

    /// One step; returns the input and weight gradients (the program drops the rest).
    pub fn step(&self, enc: &mut CommandEncoder) -> (Array, Array) {
        let y = conv_forward(enc, &self.x, &self.w, &self.params).unwrap();
        let z = layer_norm(enc, &y, Some(&self.gamma), Some(&self.beta), 1e-5).unwrap();
        // The normalised output stands in for the loss gradient.
        let (dy, _, _) =
            layer_norm_vjp(enc, &y, Some(&self.gamma), Some(&self.beta), &z, 1e-5).unwrap();
        let dx = conv_backward_data(enc, &dy, &self.w, &X_SHAPE, &self.params).unwrap();
        let dw = conv_backward_weight(enc, &self.x, &dy, &W_SHAPE, &self.params).unwrap();
        (dx, dw)
    }
}
