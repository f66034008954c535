//! What an instance does: the one [`Role`] of the workspace.

use serde::{Deserialize, Serialize};

/// What an instance (a worker) does in a disaggregated deployment: the one definition, used by
/// the policies, the simulator, the cluster's membership (etcd, the embedded registry) and the
/// wire between conductor and workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill only: computes prompts and holds their KV until a decode instance takes it.
    Prefill,
    /// Decode only: takes KV from prefill instances and generates tokens.
    Decode,
    /// Both, in one engine (vLLM-style).
    Colocated,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Role {
    /// The role's name on the command line, in etcd and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Colocated => "colocated",
        }
    }

    /// Whether it takes prefills.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Colocated)
    }

    /// Whether it takes decodes.
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Colocated)
    }
}
