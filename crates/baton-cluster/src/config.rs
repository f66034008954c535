//! `--registry` values: which membership backend to use.
//!
//! ```
//! use baton_cluster::RegistryConfig;
//!
//! assert_eq!("embedded".parse::<RegistryConfig>().unwrap(), RegistryConfig::Embedded);
//! let remote: RegistryConfig = "http://conductor:8000".parse().unwrap();
//! assert_eq!(remote, RegistryConfig::Remote { base_url: "http://conductor:8000".into() });
//! let etcd: RegistryConfig = "etcd://10.0.0.1:2379,10.0.0.2:2379/prod".parse().unwrap();
//! assert!(matches!(etcd, RegistryConfig::Etcd(ref c) if c.endpoints.len() == 2 && c.cluster == "prod"));
//! ```

use std::fmt;
use std::str::FromStr;

use crate::types::ClusterError;

/// The cluster name used in etcd keys when the URL names none.
pub const DEFAULT_CLUSTER: &str = "default";

/// A parsed `--registry` value.
#[derive(Clone, PartialEq, Eq)]
pub enum RegistryConfig {
    /// `embedded`: the registry lives inside the conductor (no external service).
    Embedded,
    /// `http://HOST:PORT` or `https://HOST:PORT` (a conductor started with `--tls-cert`): a
    /// worker in another process, talking to the conductor's embedded registry over its
    /// `/cluster/*` routes.
    Remote {
        /// The conductor's base URL, without a trailing slash.
        base_url: String,
    },
    /// `etcd://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/CLUSTER]`.
    Etcd(EtcdConfig),
}

/// Where etcd is and which key prefix the cluster uses.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `host:port` of each etcd endpoint.
    pub endpoints: Vec<String>,
    /// Cluster name: keys live under `/baton/<cluster>/workers/`.
    pub cluster: String,
    /// etcd user and password, when etcd has authentication enabled.
    pub user: Option<(String, String)>,
}

impl EtcdConfig {
    /// A config for `endpoints` and the [`DEFAULT_CLUSTER`], without etcd authentication.
    pub fn new(endpoints: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self { endpoints: endpoints.into_iter().map(Into::into).collect(), cluster: DEFAULT_CLUSTER.into(), user: None }
    }
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("cluster", &self.cluster)
            .field("user", &self.user.as_ref().map(|(name, _)| name))
            .finish()
    }
}

impl fmt::Debug for RegistryConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegistryConfig::Embedded => f.write_str("Embedded"),
            RegistryConfig::Remote { base_url } => f.debug_struct("Remote").field("base_url", base_url).finish(),
            RegistryConfig::Etcd(c) => f.debug_tuple("Etcd").field(c).finish(),
        }
    }
}

impl FromStr for RegistryConfig {
    type Err = ClusterError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let err =
            |reason: &str| ClusterError::InvalidRegistryUrl { value: value.to_owned(), reason: reason.to_owned() };
        let trimmed = value.trim();
        if trimmed.eq_ignore_ascii_case("embedded") {
            return Ok(RegistryConfig::Embedded);
        }
        let Some((scheme, rest)) = trimmed.split_once("://") else {
            return Err(err("no scheme"));
        };
        match scheme.to_ascii_lowercase().as_str() {
            scheme @ ("http" | "https") => {
                let rest = rest.trim_end_matches('/');
                if rest.contains('/') {
                    return Err(err("the conductor URL must not have a path"));
                }
                check_host_port(rest, true).map_err(|r| err(&r))?;
                Ok(RegistryConfig::Remote { base_url: format!("{scheme}://{rest}") })
            }
            "etcd" => {
                let (authority, path) = match rest.split_once('/') {
                    Some((a, p)) => (a, p.trim_matches('/')),
                    None => (rest, ""),
                };
                let (user, hosts) = match authority.rsplit_once('@') {
                    Some((userinfo, hosts)) => {
                        let Some((name, password)) = userinfo.split_once(':') else {
                            return Err(err("etcd credentials must be USER:PASSWORD@"));
                        };
                        if name.is_empty() {
                            return Err(err("empty etcd user name"));
                        }
                        (Some((name.to_owned(), password.to_owned())), hosts)
                    }
                    None => (None, authority),
                };
                let mut endpoints = Vec::new();
                for host in hosts.split(',') {
                    check_host_port(host, false).map_err(|r| err(&r))?;
                    endpoints.push(host.to_owned());
                }
                let cluster = if path.is_empty() { DEFAULT_CLUSTER.to_owned() } else { path.to_owned() };
                if !cluster.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')) {
                    return Err(err("the cluster name (URL path) may use only letters, digits, '.', '_' and '-'"));
                }
                Ok(RegistryConfig::Etcd(EtcdConfig { endpoints, cluster, user }))
            }
            other => Err(err(&format!("unknown scheme {other:?}"))),
        }
    }
}

/// Checks `host:port` (a port is required for etcd, optional for HTTP).
fn check_host_port(text: &str, port_optional: bool) -> Result<(), String> {
    if text.is_empty() {
        return Err("missing host".into());
    }
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        // [v6]:port
        let Some((host, after)) = rest.split_once(']') else { return Err(format!("unclosed '[' in {text:?}")) };
        (host, after.strip_prefix(':'))
    } else {
        match text.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (text, None),
        }
    };
    if host.is_empty() {
        return Err(format!("missing host in {text:?}"));
    }
    if host.chars().any(|c| c.is_whitespace() || matches!(c, '/' | '?' | '#' | '@')) {
        return Err(format!("bad host {host:?}"));
    }
    match port {
        Some(p) => match p.parse::<u16>() {
            Ok(0) | Err(_) => Err(format!("bad port {p:?} in {text:?}")),
            Ok(_) => Ok(()),
        },
        None if port_optional => Ok(()),
        None => Err(format!("missing port in {text:?} (etcd's client port is usually 2379)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<RegistryConfig, ClusterError> {
        s.parse()
    }

    #[test]
    fn accepted_forms() {
        assert_eq!(parse("embedded").ok(), Some(RegistryConfig::Embedded));
        assert_eq!(parse(" Embedded ").ok(), Some(RegistryConfig::Embedded));
        assert_eq!(
            parse("http://127.0.0.1:8000/").ok(),
            Some(RegistryConfig::Remote { base_url: "http://127.0.0.1:8000".into() })
        );
        assert_eq!(
            parse("http://conductor").ok(),
            Some(RegistryConfig::Remote { base_url: "http://conductor".into() })
        );
        assert_eq!(
            parse("etcd://localhost:2379").ok(),
            Some(RegistryConfig::Etcd(EtcdConfig::new(["localhost:2379"])))
        );
        let Ok(RegistryConfig::Etcd(c)) = parse("etcd://root:pw@a:1,[::1]:2/blue") else { panic!("etcd form") };
        assert_eq!(c.endpoints, vec!["a:1".to_owned(), "[::1]:2".to_owned()]);
        assert_eq!(c.cluster, "blue");
        assert_eq!(c.user, Some(("root".into(), "pw".into())));
        assert!(!format!("{c:?}").contains("pw"), "Debug must not print the password");
    }

    #[test]
    fn refused_forms_say_why() {
        for (value, needle) in [
            ("", "no scheme"),
            ("conductor:8000", "no scheme"),
            ("ftp://c:1", "unknown scheme"),
            ("etcd://host", "missing port"),
            ("etcd://host:0", "bad port"),
            ("etcd://host:99999", "bad port"),
            ("etcd://:2379", "missing host"),
            ("etcd://a:1,", "missing host"),
            ("etcd://a:1/x/y", "cluster name"),
            ("http://c:1/path", "must not have a path"),
            ("etcd://user@h:1", "USER:PASSWORD"),
        ] {
            let e = parse(value).expect_err(value).to_string();
            assert!(e.contains(needle), "{value:?}: {e}");
            assert!(e.contains("embedded"), "the error lists the accepted forms: {e}");
        }
    }
}
