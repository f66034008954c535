//! Tensor descriptions from the tensor table, and the ggml type numbers.

use std::fmt;

use candle_core::quantized::GgmlDType;

/// A ggml tensor type number as a file stores it. Kept raw so that a file holding a type
/// candle cannot load still opens; [`GgmlTypeId::dtype`] says whether it can be loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlTypeId(pub u32);

/// ggml's type numbers and names (`ggml.h`); gaps are types ggml removed.
const TYPE_NAMES: &[(u32, &str)] = &[
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (30, "BF16"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
];

impl GgmlTypeId {
    /// The candle type for this number, when candle has one.
    pub fn dtype(self) -> Option<GgmlDType> {
        Some(match self.0 {
            0 => GgmlDType::F32,
            1 => GgmlDType::F16,
            2 => GgmlDType::Q4_0,
            3 => GgmlDType::Q4_1,
            6 => GgmlDType::Q5_0,
            7 => GgmlDType::Q5_1,
            8 => GgmlDType::Q8_0,
            9 => GgmlDType::Q8_1,
            10 => GgmlDType::Q2K,
            11 => GgmlDType::Q3K,
            12 => GgmlDType::Q4K,
            13 => GgmlDType::Q5K,
            14 => GgmlDType::Q6K,
            15 => GgmlDType::Q8K,
            30 => GgmlDType::BF16,
            _ => return None,
        })
    }

    /// The number for a candle type.
    pub fn from_dtype(dtype: GgmlDType) -> Self {
        Self(match dtype {
            GgmlDType::F32 => 0,
            GgmlDType::F16 => 1,
            GgmlDType::Q4_0 => 2,
            GgmlDType::Q4_1 => 3,
            GgmlDType::Q5_0 => 6,
            GgmlDType::Q5_1 => 7,
            GgmlDType::Q8_0 => 8,
            GgmlDType::Q8_1 => 9,
            GgmlDType::Q2K => 10,
            GgmlDType::Q3K => 11,
            GgmlDType::Q4K => 12,
            GgmlDType::Q5K => 13,
            GgmlDType::Q6K => 14,
            GgmlDType::Q8K => 15,
            GgmlDType::BF16 => 30,
        })
    }

    /// ggml's name for the type (`Q4_K`), or `None` for a number ggml does not define.
    pub fn name(self) -> Option<&'static str> {
        TYPE_NAMES.iter().find(|(id, _)| *id == self.0).map(|(_, n)| *n)
    }
}

impl fmt::Display for GgmlTypeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "ggml type {}", self.0),
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Shape outermost dimension first, as candle and PyTorch write it: GGUF stores `ne`
    /// innermost first, so a linear layer's `[out, in]` weight is `ne = [in, out]` on disk.
    pub shape: Vec<usize>,
    /// The element type.
    pub ggml_type: GgmlTypeId,
    /// Byte offset of the data from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of data, when the type is one candle knows (and the element count fills whole
    /// blocks).
    pub fn byte_len(&self) -> Option<usize> {
        let dtype = self.ggml_type.dtype()?;
        let elems = self.elem_count();
        let block = dtype.block_size();
        // Quantized blocks run along the innermost dimension; a row must hold whole blocks.
        let inner = self.shape.last().copied().unwrap_or(1);
        if !inner.is_multiple_of(block) {
            return None;
        }
        (elems / block).checked_mul(dtype.type_size())
    }
}
