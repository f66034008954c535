//! Metadata values: the thirteen GGUF value types, arrays held as typed vectors.

use std::fmt;

/// The type tag of a metadata value, with the numbers the GGUF spec gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufValueType {
    /// `uint8` (0).
    U8,
    /// `int8` (1).
    I8,
    /// `uint16` (2).
    U16,
    /// `int16` (3).
    I16,
    /// `uint32` (4).
    U32,
    /// `int32` (5).
    I32,
    /// `float32` (6).
    F32,
    /// `bool` (7): one byte, 0 or 1.
    Bool,
    /// `string` (8): u64 length, then UTF-8 bytes.
    String,
    /// `array` (9): element type, u64 count, elements.
    Array,
    /// `uint64` (10).
    U64,
    /// `int64` (11).
    I64,
    /// `float64` (12).
    F64,
}

impl GgufValueType {
    /// The type for a tag read from a file.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::U8,
            1 => Self::I8,
            2 => Self::U16,
            3 => Self::I16,
            4 => Self::U32,
            5 => Self::I32,
            6 => Self::F32,
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10 => Self::U64,
            11 => Self::I64,
            12 => Self::F64,
            _ => return None,
        })
    }

    /// The tag written to a file.
    pub fn id(self) -> u32 {
        match self {
            Self::U8 => 0,
            Self::I8 => 1,
            Self::U16 => 2,
            Self::I16 => 3,
            Self::U32 => 4,
            Self::I32 => 5,
            Self::F32 => 6,
            Self::Bool => 7,
            Self::String => 8,
            Self::Array => 9,
            Self::U64 => 10,
            Self::I64 => 11,
            Self::F64 => 12,
        }
    }

    /// Bytes one value takes at least on disk (a string: its length prefix; an array: its
    /// element type and count). Bounds array counts before anything is allocated.
    pub(crate) fn min_size(self) -> u64 {
        match self {
            Self::U8 | Self::I8 | Self::Bool => 1,
            Self::U16 | Self::I16 => 2,
            Self::U32 | Self::I32 | Self::F32 => 4,
            Self::U64 | Self::I64 | Self::F64 | Self::String => 8,
            Self::Array => 12,
        }
    }
}

impl fmt::Display for GgufValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::U16 => "u16",
            Self::I16 => "i16",
            Self::U32 => "u32",
            Self::I32 => "i32",
            Self::F32 => "f32",
            Self::Bool => "bool",
            Self::String => "string",
            Self::Array => "array",
            Self::U64 => "u64",
            Self::I64 => "i64",
            Self::F64 => "f64",
        };
        f.write_str(name)
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float32`.
    F32(f32),
    /// `float64`.
    F64(f64),
    /// `bool`.
    Bool(bool),
    /// `string`.
    String(String),
    /// `array`.
    Array(GgufArray),
}

impl GgufValue {
    /// The value's type tag.
    pub fn value_type(&self) -> GgufValueType {
        match self {
            Self::U8(_) => GgufValueType::U8,
            Self::I8(_) => GgufValueType::I8,
            Self::U16(_) => GgufValueType::U16,
            Self::I16(_) => GgufValueType::I16,
            Self::U32(_) => GgufValueType::U32,
            Self::I32(_) => GgufValueType::I32,
            Self::U64(_) => GgufValueType::U64,
            Self::I64(_) => GgufValueType::I64,
            Self::F32(_) => GgufValueType::F32,
            Self::F64(_) => GgufValueType::F64,
            Self::Bool(_) => GgufValueType::Bool,
            Self::String(_) => GgufValueType::String,
            Self::Array(_) => GgufValueType::Array,
        }
    }

    /// Any integer value, widened; `None` for floats, bools, strings and arrays.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Self::U8(v) => v.into(),
            Self::I8(v) => v.into(),
            Self::U16(v) => v.into(),
            Self::I16(v) => v.into(),
            Self::U32(v) => v.into(),
            Self::I32(v) => v.into(),
            Self::U64(v) => v.into(),
            Self::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any float value, widened; `None` otherwise.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A short description for error messages: the type, and for arrays the element type.
    pub fn describe(&self) -> String {
        match self {
            Self::Array(a) => format!("array of {} {}", a.len(), a.element_type()),
            v => v.value_type().to_string(),
        }
    }
}

/// An array value, stored as a vector of its element type.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    /// `uint8` elements.
    U8(Vec<u8>),
    /// `int8` elements.
    I8(Vec<i8>),
    /// `uint16` elements.
    U16(Vec<u16>),
    /// `int16` elements.
    I16(Vec<i16>),
    /// `uint32` elements.
    U32(Vec<u32>),
    /// `int32` elements.
    I32(Vec<i32>),
    /// `uint64` elements.
    U64(Vec<u64>),
    /// `int64` elements.
    I64(Vec<i64>),
    /// `float32` elements.
    F32(Vec<f32>),
    /// `float64` elements.
    F64(Vec<f64>),
    /// `bool` elements.
    Bool(Vec<bool>),
    /// `string` elements.
    String(Vec<String>),
    /// Nested arrays (each may have its own element type).
    Array(Vec<GgufArray>),
}

impl GgufArray {
    /// The element type.
    pub fn element_type(&self) -> GgufValueType {
        match self {
            Self::U8(_) => GgufValueType::U8,
            Self::I8(_) => GgufValueType::I8,
            Self::U16(_) => GgufValueType::U16,
            Self::I16(_) => GgufValueType::I16,
            Self::U32(_) => GgufValueType::U32,
            Self::I32(_) => GgufValueType::I32,
            Self::U64(_) => GgufValueType::U64,
            Self::I64(_) => GgufValueType::I64,
            Self::F32(_) => GgufValueType::F32,
            Self::F64(_) => GgufValueType::F64,
            Self::Bool(_) => GgufValueType::Bool,
            Self::String(_) => GgufValueType::String,
            Self::Array(_) => GgufValueType::Array,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::I8(v) => v.len(),
            Self::U16(v) => v.len(),
            Self::I16(v) => v.len(),
            Self::U32(v) => v.len(),
            Self::I32(v) => v.len(),
            Self::U64(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::F64(v) => v.len(),
            Self::Bool(v) => v.len(),
            Self::String(v) => v.len(),
            Self::Array(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as `i64`, for integer arrays whose values all fit.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        fn conv<T: Copy + TryInto<i64>>(v: &[T]) -> Option<Vec<i64>> {
            v.iter().map(|&x| x.try_into().ok()).collect()
        }
        match self {
            Self::U8(v) => conv(v),
            Self::I8(v) => conv(v),
            Self::U16(v) => conv(v),
            Self::I16(v) => conv(v),
            Self::U32(v) => conv(v),
            Self::I32(v) => conv(v),
            Self::U64(v) => conv(v),
            Self::I64(v) => conv(v),
            _ => None,
        }
    }
}

/// A Rust type a metadata value converts into: the target of
/// [`GgufMetadata::get`](super::GgufMetadata::get).
///
/// Integer targets take any integer value that fits (writers disagree on `u32` versus `i32` or
/// `u64`); float targets take `f32` or `f64`; borrowed targets (`&str`, `&[String]`, `&[f32]`,
/// `&[i32]`, `&GgufArray`) need exactly that type.
pub trait FromGgufValue<'a>: Sized {
    /// What the target expects, for error messages.
    const EXPECTED: &'static str;
    /// The converted value, or `None` when the value has another type or does not fit.
    fn from_value(value: &'a GgufValue) -> Option<Self>;
}

macro_rules! from_int {
    ($($t:ty),*) => {$(
        impl FromGgufValue<'_> for $t {
            const EXPECTED: &'static str = concat!("an integer that fits ", stringify!($t));
            fn from_value(value: &GgufValue) -> Option<Self> {
                value.as_i128().and_then(|v| <$t>::try_from(v).ok())
            }
        }
    )*};
}
from_int!(u8, u16, u32, u64, usize, i32, i64);

impl FromGgufValue<'_> for f32 {
    const EXPECTED: &'static str = "a float";
    #[allow(clippy::cast_possible_truncation)]
    fn from_value(value: &GgufValue) -> Option<Self> {
        // f64 metadata narrowed to the f32 the model computes in.
        value.as_f64().map(|v| v as f32)
    }
}

impl FromGgufValue<'_> for f64 {
    const EXPECTED: &'static str = "a float";
    fn from_value(value: &GgufValue) -> Option<Self> {
        value.as_f64()
    }
}

impl FromGgufValue<'_> for bool {
    const EXPECTED: &'static str = "a bool";
    fn from_value(value: &GgufValue) -> Option<Self> {
        match *value {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }
}

impl<'a> FromGgufValue<'a> for &'a str {
    const EXPECTED: &'static str = "a string";
    fn from_value(value: &'a GgufValue) -> Option<Self> {
        match value {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
}

impl<'a> FromGgufValue<'a> for &'a GgufArray {
    const EXPECTED: &'static str = "an array";
    fn from_value(value: &'a GgufValue) -> Option<Self> {
        match value {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl<'a> FromGgufValue<'a> for &'a [String] {
    const EXPECTED: &'static str = "an array of strings";
    fn from_value(value: &'a GgufValue) -> Option<Self> {
        match value {
            GgufValue::Array(GgufArray::String(v)) => Some(v),
            _ => None,
        }
    }
}

impl<'a> FromGgufValue<'a> for &'a [f32] {
    const EXPECTED: &'static str = "an array of f32";
    fn from_value(value: &'a GgufValue) -> Option<Self> {
        match value {
            GgufValue::Array(GgufArray::F32(v)) => Some(v),
            _ => None,
        }
    }
}

impl<'a> FromGgufValue<'a> for &'a [i32] {
    const EXPECTED: &'static str = "an array of i32";
    fn from_value(value: &'a GgufValue) -> Option<Self> {
        match value {
            GgufValue::Array(GgufArray::I32(v)) => Some(v),
            _ => None,
        }
    }
}
