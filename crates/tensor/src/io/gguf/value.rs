//! GGUF metadata values: the thirteen value types of the format (`enum gguf_type` in ggml, numbered
//! as there) and typed accessors that convert between compatible numeric types without loss.

use std::fmt;

/// A metadata value type, numbered as GGUF numbers it on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgufValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl GgufValueType {
    pub fn from_u32(id: u32) -> Option<GgufValueType> {
        use GgufValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// The fewest bytes one value of this type takes on disk: the fixed size of a scalar, the
    /// length prefix of a string, the element type and count of an array. Used to bound counts
    /// read from a file by the bytes that remain.
    pub fn min_encoded_size(self) -> u64 {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    /// Name as the GGUF spec writes it (`uint32`, `string`, ...).
    pub fn name(self) -> &'static str {
        use GgufValueType::*;
        match self {
            U8 => "uint8",
            I8 => "int8",
            U16 => "uint16",
            I16 => "int16",
            U32 => "uint32",
            I32 => "int32",
            F32 => "float32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "uint64",
            I64 => "int64",
            F64 => "float64",
        }
    }
}

impl fmt::Display for GgufValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A typed array. Every element has type `elem_type`; arrays of arrays are allowed (each inner
/// array carries its own element type).
#[derive(Clone, Debug, PartialEq)]
pub struct GgufArray {
    pub elem_type: GgufValueType,
    pub values: Vec<GgufValue>,
}

impl GgufArray {
    /// An array whose elements all have `elem_type`; `None` if one of them does not.
    pub fn new(elem_type: GgufValueType, values: Vec<GgufValue>) -> Option<GgufArray> {
        if values.iter().all(|v| v.value_type() == elem_type) {
            Some(GgufArray { elem_type, values })
        } else {
            None
        }
    }
    pub fn len(&self) -> usize {
        self.values.len()
    }
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(_) => GgufValueType::Array,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F64(_) => GgufValueType::F64,
        }
    }

    /// Any integer type holding a non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type holding a value that fits in `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any numeric type, converted to `f32` (64-bit values are rounded: hyperparameters such as
    /// `rope.freq_base` are stored as f32 by ggml anyway).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(v) => Some(v),
            GgufValue::F64(v) => Some(v as f32),
            _ => self
                .as_i64()
                .map(|v| v as f32)
                .or_else(|| self.as_u64().map(|v| v as f32)),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Arrays longer than this print their first elements and a count (a vocabulary has 150k).
const DISPLAY_ARRAY_HEAD: usize = 8;

impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufValue::U8(v) => write!(f, "{v}"),
            GgufValue::I8(v) => write!(f, "{v}"),
            GgufValue::U16(v) => write!(f, "{v}"),
            GgufValue::I16(v) => write!(f, "{v}"),
            GgufValue::U32(v) => write!(f, "{v}"),
            GgufValue::I32(v) => write!(f, "{v}"),
            GgufValue::U64(v) => write!(f, "{v}"),
            GgufValue::I64(v) => write!(f, "{v}"),
            GgufValue::F32(v) => write!(f, "{v}"),
            GgufValue::F64(v) => write!(f, "{v}"),
            GgufValue::Bool(v) => write!(f, "{v}"),
            GgufValue::String(s) => write!(f, "{s:?}"),
            GgufValue::Array(a) => {
                f.write_str("[")?;
                for (i, v) in a.values.iter().take(DISPLAY_ARRAY_HEAD).enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                if a.values.len() > DISPLAY_ARRAY_HEAD {
                    write!(f, ", ... ({} {} values)", a.values.len(), a.elem_type)?;
                }
                f.write_str("]")
            }
        }
    }
}

macro_rules! from_scalar {
    ($($t:ty => $v:ident),*) => {$(
        impl From<$t> for GgufValue {
            fn from(x: $t) -> GgufValue { GgufValue::$v(x) }
        }
    )*};
}
from_scalar!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, u64 => U64, i64 => I64, f64 => F64, GgufArray => Array);

impl From<&str> for GgufValue {
    fn from(s: &str) -> GgufValue {
        GgufValue::String(s.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_round_trip() {
        for id in 0..13 {
            assert_eq!(GgufValueType::from_u32(id).map(|t| t.id()), Some(id));
        }
        assert_eq!(GgufValueType::from_u32(13), None);
    }

    #[test]
    fn numeric_accessors_convert_without_loss() {
        assert_eq!(GgufValue::I32(-1).as_u64(), None);
        assert_eq!(GgufValue::I32(7).as_u64(), Some(7));
        assert_eq!(GgufValue::U64(u64::MAX).as_i64(), None);
        assert_eq!(GgufValue::U16(3).as_f32(), Some(3.0));
        assert_eq!(GgufValue::F64(0.5).as_f32(), Some(0.5));
        assert_eq!(GgufValue::Bool(true).as_u64(), None);
        assert_eq!(GgufValue::from("x").as_str(), Some("x"));
    }

    #[test]
    fn array_new_checks_element_types() {
        assert!(GgufArray::new(GgufValueType::U8, vec![GgufValue::U8(1)]).is_some());
        assert!(GgufArray::new(GgufValueType::U8, vec![GgufValue::I8(1)]).is_none());
    }
}
