//! `Tensor`: a dense, row-major f32 activation on the CPU. Weights are not Tensors: they stay in
//! their stored form in [`crate::QTensor`]. Shapes are written outermost first, e.g. `(T, D)`.

use crate::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: &[usize], data: Vec<f32>) -> Result<Tensor> {
        let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if n != Some(data.len()) {
            return Err(Error::Shape(format!(
                "shape {:?} does not hold {} elements",
                shape,
                data.len()
            )));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            data,
        })
    }
    pub fn zeros(shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor {
            shape: shape.to_vec(),
            data: vec![0.0; n],
        }
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn dims2(&self) -> (usize, usize) {
        match self.shape.as_slice() {
            [a, b] => (*a, *b),
            [b] => (1, *b),
            s => {
                let last = *s.last().unwrap_or(&1);
                (self.data.len() / last.max(1), last)
            }
        }
    }
    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    pub fn data(&self) -> &[f32] {
        &self.data
    }
    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
    pub fn into_data(self) -> Vec<f32> {
        self.data
    }
    /// Row `i` of a tensor viewed as `(rows, last_dim)`.
    pub fn row(&self, i: usize) -> &[f32] {
        let (_, c) = self.dims2();
        &self.data[i * c..(i + 1) * c]
    }
    pub fn reshape(mut self, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if n != self.data.len() {
            return Err(Error::Shape(format!(
                "cannot reshape {:?} to {:?}",
                self.shape, shape
            )));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }
}
