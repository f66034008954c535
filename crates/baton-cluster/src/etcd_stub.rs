//! [`EtcdRegistry`] when Baton is built without the `etcd` feature: the same names, but
//! [`EtcdRegistry::connect`] fails with [`ClusterError::EtcdNotBuilt`], which tells the user to
//! rebuild with `--features etcd`. The real backend is `etcd.rs`; it needs etcd-client, whose
//! build script needs `protoc`, which a fresh machine does not have.

use std::time::Duration;

use crate::auth::ClusterSecret;
use crate::config::EtcdConfig;
use crate::registry::{Lease, MembershipWatch, Registry};
use crate::types::{ClusterError, WorkerInfo};

/// Timeouts of the etcd backend (unused in this build; kept so callers compile either way).
#[derive(Clone, Copy, Debug)]
pub struct EtcdOptions {
    /// Limit on each unary etcd call.
    pub request_timeout: Duration,
    /// Limit on connecting to etcd.
    pub connect_timeout: Duration,
    /// Pause before a watch re-reads the prefix after its stream failed.
    pub retry_delay: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            retry_delay: Duration::from_millis(500),
        }
    }
}

/// A registry in etcd — which this build cannot reach: it has no value, so every method is
/// unreachable and [`EtcdRegistry::connect`] always fails.
#[derive(Debug)]
pub enum EtcdRegistry {}

impl EtcdRegistry {
    /// Fails with [`ClusterError::EtcdNotBuilt`].
    pub async fn connect(config: &EtcdConfig, secret: ClusterSecret) -> Result<Self, ClusterError> {
        Self::connect_with(config, secret, EtcdOptions::default()).await
    }

    /// Fails with [`ClusterError::EtcdNotBuilt`].
    pub async fn connect_with(
        _config: &EtcdConfig,
        _secret: ClusterSecret,
        _options: EtcdOptions,
    ) -> Result<Self, ClusterError> {
        Err(ClusterError::EtcdNotBuilt)
    }

    /// The key prefix this cluster's registrations live under.
    pub fn prefix(&self) -> &str {
        match *self {}
    }
}

#[async_trait::async_trait]
impl Registry for EtcdRegistry {
    async fn register(&self, _info: WorkerInfo, _ttl: Duration) -> Result<Lease, ClusterError> {
        match *self {}
    }

    async fn deregister(&self, _lease: Lease) -> Result<(), ClusterError> {
        match *self {}
    }

    async fn list(&self) -> Result<Vec<WorkerInfo>, ClusterError> {
        match *self {}
    }

    async fn watch(&self) -> Result<MembershipWatch, ClusterError> {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RegistryConfig;

    #[tokio::test]
    async fn etcd_url_without_the_feature_says_how_to_rebuild() {
        let config: RegistryConfig = "etcd://127.0.0.1:2379".parse().expect("parses");
        let secret = ClusterSecret::new("s").expect("secret");
        let err = crate::connect(&config, secret).await.err().expect("no etcd in this build");
        assert!(matches!(err, ClusterError::EtcdNotBuilt), "{err:?}");
        assert!(err.to_string().contains("--features etcd"), "{err}");
    }
}
