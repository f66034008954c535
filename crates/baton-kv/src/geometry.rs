//! KV geometry, layouts and tensor descriptors.
//!
//! The KV cache of an instance is one 6-dimensional tensor. Its logical dimensions are always
//! the same ([`Dim`]); the layout decides their order in memory:
//!
//! - [`KvLayout::LayerMajor`] `[L][2][blocks][T][H][D]`, as vLLM keeps it: one block of one
//!   request is `2·L` separate ranges.
//! - [`KvLayout::BlockMajor`] `[blocks][L][2][T][H][D]`, as FlowKV and MemServe keep it: one block
//!   is one contiguous range, and adjacent block ids merge into one range.
//!
//! In both layouts the `[T][H][D]` slab of one (layer, key-or-value, block) is contiguous, which
//! is what attention reads.

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 32-bit IEEE float, what the CPU engine computes in.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    Bf16,
}

impl KvDtype {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }
}

/// Shape of one instance's KV cache, independent of its layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvGeometry {
    /// Transformer layers (L).
    pub layers: usize,
    /// Key/value heads per layer (H).
    pub kv_heads: usize,
    /// Elements per head (D).
    pub head_dim: usize,
    /// Tokens per block (T).
    pub block_size: usize,
    /// Element type.
    pub dtype: KvDtype,
}

impl KvGeometry {
    /// A float32 geometry.
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, block_size: usize) -> Self {
        Self { layers, kv_heads, head_dim, block_size, dtype: KvDtype::F32 }
    }

    /// Elements of one token's key (or value) in one layer: `H·D`.
    pub fn token_elems(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Elements of one block in one layer for keys or values: `T·H·D`.
    pub fn slab_elems(&self) -> usize {
        self.block_size * self.token_elems()
    }

    /// Elements of one whole block across all layers, keys and values: `L·2·T·H·D`.
    pub fn block_elems(&self) -> usize {
        self.layers * 2 * self.slab_elems()
    }

    /// Bytes of KV one token occupies in the instance: `2·L·H·D·sizeof(dtype)`.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.token_elems() * self.dtype.size()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// Key or value half of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvPart {
    /// Keys.
    Key = 0,
    /// Values.
    Value = 1,
}

/// Order of the KV dimensions in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvLayout {
    /// `[L][2][blocks][T][H][D]` (vLLM).
    LayerMajor,
    /// `[blocks][L][2][T][H][D]` (FlowKV, MemServe): one block is one contiguous range.
    #[default]
    BlockMajor,
}

impl KvLayout {
    /// Dimensions from outermost to innermost.
    pub fn dims(self) -> [Dim; 6] {
        match self {
            KvLayout::LayerMajor => [Dim::Layer, Dim::Kv, Dim::Block, Dim::Token, Dim::Head, Dim::HeadDim],
            KvLayout::BlockMajor => [Dim::Block, Dim::Layer, Dim::Kv, Dim::Token, Dim::Head, Dim::HeadDim],
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" | "float32" => Ok(KvDtype::F32),
            "f16" | "float16" => Ok(KvDtype::F16),
            "bf16" | "bfloat16" => Ok(KvDtype::Bf16),
            other => Err(format!("unknown KV dtype `{other}` (expected f32, f16 or bf16)")),
        }
    }
}

impl std::str::FromStr for KvLayout {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "layer-major" | "layer_major" => Ok(KvLayout::LayerMajor),
            "block-major" | "block_major" => Ok(KvLayout::BlockMajor),
            other => Err(format!("unknown KV layout `{other}` (expected layer-major or block-major)")),
        }
    }
}

/// A logical dimension of the KV tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dim {
    /// Transformer layer.
    Layer = 0,
    /// Key (0) or value (1).
    Kv = 1,
    /// Block id.
    Block = 2,
    /// Token slot within a block.
    Token = 3,
    /// KV head.
    Head = 4,
    /// Element within a head.
    HeadDim = 5,
}

/// Describes a KV tensor in memory: dimension order, shape and strides (in elements), element
/// size and base byte offset. This is what peers exchange (KVDirect's tensor-centric metadata),
/// and all address arithmetic goes through it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorDescriptor {
    /// Dimensions from outermost to innermost.
    pub dims: [Dim; 6],
    /// Extent of each dimension, in `dims` order.
    pub shape: [usize; 6],
    /// Stride of each dimension in elements, in `dims` order.
    pub strides: [usize; 6],
    /// Bytes per element.
    pub elem_size: usize,
    /// Byte offset of element zero within its region.
    pub base: usize,
}

impl TensorDescriptor {
    /// The descriptor of a dense tensor of `num_blocks` blocks in `layout`.
    pub fn new(geometry: &KvGeometry, layout: KvLayout, num_blocks: usize) -> Self {
        Self::dense(geometry, layout.dims(), num_blocks)
    }

    /// The descriptor of a dense tensor of `num_blocks` blocks with dimensions in any order
    /// (`dims` must be a permutation of the six), outermost first.
    pub fn dense(geometry: &KvGeometry, dims: [Dim; 6], num_blocks: usize) -> Self {
        let extent = |d: Dim| match d {
            Dim::Layer => geometry.layers,
            Dim::Kv => 2,
            Dim::Block => num_blocks,
            Dim::Token => geometry.block_size,
            Dim::Head => geometry.kv_heads,
            Dim::HeadDim => geometry.head_dim,
        };
        let shape = dims.map(extent);
        let mut strides = [0; 6];
        let mut acc = 1;
        for i in (0..6).rev() {
            strides[i] = acc;
            acc *= shape[i];
        }
        Self { dims, shape, strides, elem_size: geometry.dtype.size(), base: 0 }
    }

    /// Total elements described.
    pub fn num_elems(&self) -> usize {
        self.shape.iter().product()
    }

    /// Stride of a logical dimension, in elements.
    pub fn stride(&self, dim: Dim) -> usize {
        self.strides[self.position(dim)]
    }

    /// Extent of a logical dimension.
    pub fn extent(&self, dim: Dim) -> usize {
        self.shape[self.position(dim)]
    }

    fn position(&self, dim: Dim) -> usize {
        // `dims` is a permutation of all six dimensions, so the search always succeeds.
        self.dims.iter().position(|&d| d == dim).unwrap_or(0)
    }

    /// Element offset of `[layer][part][block][token][head][0]`.
    pub fn offset(&self, layer: usize, part: KvPart, block: usize, token: usize, head: usize) -> usize {
        layer * self.stride(Dim::Layer)
            + part as usize * self.stride(Dim::Kv)
            + block * self.stride(Dim::Block)
            + token * self.stride(Dim::Token)
            + head * self.stride(Dim::Head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_major_block_is_one_contiguous_range() {
        let g = KvGeometry::new(3, 2, 4, 5);
        let d = TensorDescriptor::new(&g, KvLayout::BlockMajor, 7);
        assert_eq!(d.stride(Dim::Block), g.block_elems());
        assert_eq!(d.offset(0, KvPart::Key, 2, 0, 0), 2 * g.block_elems());
        assert_eq!(d.num_elems(), 7 * g.block_elems());
    }

    #[test]
    fn layer_major_matches_vllm_order() {
        let g = KvGeometry::new(3, 2, 4, 5);
        let d = TensorDescriptor::new(&g, KvLayout::LayerMajor, 7);
        assert_eq!(d.stride(Dim::Layer), 2 * 7 * g.slab_elems());
        assert_eq!(d.stride(Dim::Kv), 7 * g.slab_elems());
        assert_eq!(d.offset(1, KvPart::Value, 2, 3, 1), 2 * 7 * 40 + 7 * 40 + 2 * 40 + 3 * 8 + 4);
    }

    #[test]
    fn slab_is_contiguous_in_both_layouts() {
        let g = KvGeometry::new(2, 3, 4, 5);
        for layout in [KvLayout::LayerMajor, KvLayout::BlockMajor] {
            let d = TensorDescriptor::new(&g, layout, 4);
            assert_eq!(d.stride(Dim::HeadDim), 1);
            assert_eq!(d.stride(Dim::Head), g.head_dim);
            assert_eq!(d.stride(Dim::Token), g.token_elems());
        }
    }

    #[test]
    fn layout_parses() {
        assert_eq!("layer-major".parse::<KvLayout>(), Ok(KvLayout::LayerMajor));
        assert!("diagonal".parse::<KvLayout>().is_err());
    }
}
