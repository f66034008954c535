//! What the hostile-peer tests share: a KV server with a short handshake deadline and a small
//! handshake cap.

use std::time::Duration;

use baton_kv::{KvDtype, KvGeometry, KvLayout, TensorDescriptor};
use baton_transfer::{Compat, KvServer, PeerId, Region, ServerConfig};

pub(crate) fn geometry() -> KvGeometry {
    KvGeometry { dtype: KvDtype::F16, ..KvGeometry::new(2, 2, 4, 4) }
}

/// A server whose handshakes must finish within 300 ms, at most 8 at once.
pub(crate) fn guarded_server() -> (KvServer, std::sync::mpsc::Receiver<baton_transfer::Release>) {
    guarded_server_with(Duration::from_millis(300))
}

/// A server whose handshakes must finish within `handshake_timeout`, at most 8 strangers' at once.
pub(crate) fn guarded_server_with(
    handshake_timeout: Duration,
) -> (KvServer, std::sync::mpsc::Receiver<baton_transfer::Release>) {
    let desc = TensorDescriptor::new(&geometry(), KvLayout::LayerMajor, 16);
    let region = Region::create(desc).expect("region");
    let (tx, rx) = std::sync::mpsc::channel();
    let config = ServerConfig {
        handshake_timeout,
        max_handshakes: 8,
        ..ServerConfig::new(PeerId(1), Compat::new("m", geometry()), "s3cret")
    };
    (KvServer::start(config, region, tx).expect("server"), rx)
}
