//! What two peers must agree on before any KV moves: model, geometry, dtype, block size and the
//! version of the layout description. The layout itself may differ (a layer-major prefill and a
//! block-major decode exchange KV fine): it travels as a [`TensorDescriptor`].

use baton_kv::{KvDtype, KvGeometry, TensorDescriptor};

/// Version of the layout description ([`TensorDescriptor`] semantics). Bump when the meaning of
/// dims, shape or strides changes.
pub const LAYOUT_VERSION: u32 = 1;

/// The compatibility-relevant facts of one side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compat {
    /// Model identifier (e.g. the checkpoint's name and revision).
    pub model: String,
    /// KV geometry: layers, heads, head dim, block size, dtype.
    pub geometry: KvGeometry,
    /// [`LAYOUT_VERSION`] of the sender.
    pub layout_version: u32,
}

impl Compat {
    /// The facts for `model` at `geometry`, with this build's layout version.
    pub fn new(model: impl Into<String>, geometry: KvGeometry) -> Self {
        Self { model: model.into(), geometry, layout_version: LAYOUT_VERSION }
    }

    /// A stable 64-bit hash (FNV-1a over an explicit little-endian encoding) of model, geometry,
    /// dtype, block size and layout version. Equal hashes are the fast path; on a mismatch
    /// [`Compat::mismatch`] says what differs.
    pub fn hash(&self) -> u64 {
        let mut bytes = Vec::with_capacity(64 + self.model.len());
        bytes.extend_from_slice(&(self.model.len() as u64).to_le_bytes());
        bytes.extend_from_slice(self.model.as_bytes());
        for v in [self.geometry.layers, self.geometry.kv_heads, self.geometry.head_dim, self.geometry.block_size] {
            bytes.extend_from_slice(&(v as u64).to_le_bytes());
        }
        bytes.push(dtype_code(self.geometry.dtype));
        bytes.extend_from_slice(&self.layout_version.to_le_bytes());
        baton_kv::fnv1a_64(&bytes)
    }

    /// `None` when the two sides can exchange KV; otherwise a message naming every difference.
    pub fn mismatch(&self, theirs: &Compat) -> Option<String> {
        let mut diffs = Vec::new();
        if self.model != theirs.model {
            diffs.push(format!("model `{}` vs `{}`", self.model, theirs.model));
        }
        let (a, b) = (&self.geometry, &theirs.geometry);
        for (name, x, y) in [
            ("layers", a.layers, b.layers),
            ("kv heads", a.kv_heads, b.kv_heads),
            ("head dim", a.head_dim, b.head_dim),
            ("block size", a.block_size, b.block_size),
        ] {
            if x != y {
                diffs.push(format!("{name} {x} vs {y}"));
            }
        }
        if a.dtype != b.dtype {
            diffs.push(format!("dtype {:?} vs {:?}", a.dtype, b.dtype));
        }
        if self.layout_version != theirs.layout_version {
            diffs.push(format!("layout version {} vs {}", self.layout_version, theirs.layout_version));
        }
        if diffs.is_empty() { None } else { Some(format!("ours vs theirs: {}", diffs.join(", "))) }
    }

    /// Checks that `descriptor` describes KV of this geometry (element size included).
    pub fn check_descriptor(&self, descriptor: &TensorDescriptor) -> Result<(), String> {
        use baton_kv::Dim;
        let g = &self.geometry;
        let want = [
            (Dim::Layer, g.layers),
            (Dim::Kv, 2),
            (Dim::Token, g.block_size),
            (Dim::Head, g.kv_heads),
            (Dim::HeadDim, g.head_dim),
        ];
        for (dim, n) in want {
            if descriptor.extent(dim) != n {
                return Err(format!("descriptor has {} along {dim:?}, geometry says {n}", descriptor.extent(dim)));
            }
        }
        if descriptor.elem_size != g.dtype.size() {
            return Err(format!(
                "descriptor elements are {} bytes, {:?} is {}",
                descriptor.elem_size,
                g.dtype,
                g.dtype.size()
            ));
        }
        Ok(())
    }
}

/// Wire code of a dtype.
pub(crate) fn dtype_code(d: KvDtype) -> u8 {
    match d {
        KvDtype::F32 => 0,
        KvDtype::F16 => 1,
        KvDtype::Bf16 => 2,
    }
}

/// Dtype from its wire code.
pub(crate) fn dtype_from_code(c: u8) -> Option<KvDtype> {
    match c {
        0 => Some(KvDtype::F32),
        1 => Some(KvDtype::F16),
        2 => Some(KvDtype::Bf16),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_stable_and_sensitive() {
        let g = KvGeometry { dtype: KvDtype::F16, ..KvGeometry::new(32, 8, 128, 16) };
        let a = Compat::new("llama-3-8b", g);
        // Pinned: the hash is part of the protocol, it must not change across builds.
        assert_eq!(a.hash(), Compat::new("llama-3-8b", g).hash());
        assert_eq!(a.hash(), 0x0dd3_4109_174d_b50d, "golden value: {:#x}", a.hash());
        let b = Compat::new("llama-3-8b", KvGeometry { block_size: 32, ..g });
        assert_ne!(a.hash(), b.hash());
        assert!(a.mismatch(&b).is_some_and(|m| m.contains("block size 16 vs 32")));
        assert!(a.mismatch(&a).is_none());
    }
}
