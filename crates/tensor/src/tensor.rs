//! `Tensor`: a dense, row-major f32 activation, on the host or on a device. Weights are not
//! Tensors: they stay in their stored form in [`crate::QTensor`]. Shapes are written outermost
//! first, e.g. `(T, D)`.
//!
//! Model code never reads a tensor's values itself: it calls the ops of a
//! [`crate::op::Backend`], so the same architecture code runs where the backend keeps its
//! tensors. Host code that needs the numbers (sampling, tests) asks the backend for a host copy
//! ([`crate::op::Backend::to_host`]) and then reads [`Tensor::data`].

use std::any::Any;
use std::sync::Arc;

use crate::{Error, Result};

const DEVICE_READ: &str = "host read of a device tensor: copy it with Backend::to_host first";

#[derive(Clone, Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

#[derive(Clone, Debug)]
enum Storage {
    Host(Vec<f32>),
    Device(DeviceSpan),
}

/// `len` f32 values at device address `ptr`, kept alive by `owner` (a device backend's buffer
/// or arena). Only the backend that made it knows how to read it.
#[derive(Clone)]
pub struct DeviceSpan {
    pub ptr: u64,
    pub len: usize,
    pub owner: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for DeviceSpan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceSpan({:#x}, {} values)", self.ptr, self.len)
    }
}

impl PartialEq for Tensor {
    /// Host tensors compare by shape and values; device tensors only by identity.
    fn eq(&self, other: &Tensor) -> bool {
        self.shape == other.shape
            && match (&self.storage, &other.storage) {
                (Storage::Host(a), Storage::Host(b)) => a == b,
                (Storage::Device(a), Storage::Device(b)) => a.ptr == b.ptr && a.len == b.len,
                _ => false,
            }
    }
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
            storage: Storage::Host(data),
        })
    }
    pub fn zeros(shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor {
            shape: shape.to_vec(),
            storage: Storage::Host(vec![0.0; n]),
        }
    }
    /// A device tensor over `span` (a device backend's constructor).
    pub fn on_device(shape: &[usize], span: DeviceSpan) -> Result<Tensor> {
        let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if n != Some(span.len) {
            return Err(Error::Shape(format!(
                "shape {:?} does not hold {} elements",
                shape, span.len
            )));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            storage: Storage::Device(span),
        })
    }
    /// Whether the values live in host memory (then [`Tensor::data`] reads them).
    pub fn is_host(&self) -> bool {
        matches!(self.storage, Storage::Host(_))
    }
    /// The device span of a device tensor.
    pub fn device_span(&self) -> Option<&DeviceSpan> {
        match &self.storage {
            Storage::Device(s) => Some(s),
            Storage::Host(_) => None,
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
                (self.len() / last.max(1), last)
            }
        }
    }
    pub fn len(&self) -> usize {
        match &self.storage {
            Storage::Host(d) => d.len(),
            Storage::Device(s) => s.len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The values of a host tensor.
    ///
    /// # Panics
    /// On a device tensor: that is a bug in the caller (model code goes through the backend's
    /// ops; host code copies with `Backend::to_host` first), never a property of the input.
    pub fn data(&self) -> &[f32] {
        match &self.storage {
            Storage::Host(d) => d,
            Storage::Device(_) => panic!("{}", DEVICE_READ),
        }
    }
    /// See [`Tensor::data`].
    pub fn data_mut(&mut self) -> &mut [f32] {
        match &mut self.storage {
            Storage::Host(d) => d,
            Storage::Device(_) => panic!("{}", DEVICE_READ),
        }
    }
    /// See [`Tensor::data`].
    pub fn into_data(self) -> Vec<f32> {
        match self.storage {
            Storage::Host(d) => d,
            Storage::Device(_) => panic!("{}", DEVICE_READ),
        }
    }
    /// Row `i` of a host tensor viewed as `(rows, last_dim)` (see [`Tensor::data`]).
    pub fn row(&self, i: usize) -> &[f32] {
        let (_, c) = self.dims2();
        &self.data()[i * c..(i + 1) * c]
    }
    pub fn reshape(mut self, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if n != self.len() {
            return Err(Error::Shape(format!(
                "cannot reshape {:?} to {:?}",
                self.shape, shape
            )));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }
}
