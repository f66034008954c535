//! [`connect`]: the registry a `--registry` value names, opened with its backend. It sits above
//! the backends, which all use the [`Registry`] trait's module, so that module names none of them.

use std::sync::Arc;

use crate::auth::ClusterSecret;
use crate::config::RegistryConfig;
use crate::embedded::EmbeddedRegistry;
use crate::etcd::EtcdRegistry;
use crate::registry::Registry;
use crate::remote::{RemoteOptions, RemoteRegistryClient};
use crate::types::ClusterError;

/// Opens the registry a `--registry` value names, for a process that registers or watches.
///
/// `embedded` starts a fresh [`EmbeddedRegistry`] in this process (what `baton serve` uses); a
/// conductor that also serves the `/cluster/*` routes should call [`EmbeddedRegistry::start`]
/// itself so it keeps the concrete handle for [`crate::router`].
pub async fn connect(config: &RegistryConfig, secret: ClusterSecret) -> Result<Arc<dyn Registry>, ClusterError> {
    connect_with_ca(config, secret, None).await
}

/// [`connect`], trusting the certificates of `ca_pem` (PEM) for an `https://` conductor.
pub async fn connect_with_ca(
    config: &RegistryConfig,
    secret: ClusterSecret,
    ca_pem: Option<&[u8]>,
) -> Result<Arc<dyn Registry>, ClusterError> {
    Ok(match config {
        RegistryConfig::Embedded => Arc::new(EmbeddedRegistry::start(secret)),
        RegistryConfig::Remote { base_url } => {
            Arc::new(RemoteRegistryClient::with_tls(base_url, secret, RemoteOptions::default(), ca_pem)?)
        }
        RegistryConfig::Etcd(etcd) => Arc::new(EtcdRegistry::connect(etcd, secret).await?),
    })
}
