//! Router addresses: each configured URL stands for every address its host
//! resolves to (a headless Kubernetes service lists all router replicas), so
//! every replica gets every push. Re-resolved at every sync.

use std::net::IpAddr;

use reqwest::Url;

use crate::state::RouterTarget;

/// Why a router URL could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("router URL {0:?} has no host")]
    NoHost(String),
    #[error("cannot resolve router host of {url}")]
    Lookup {
        url: String,
        #[source]
        source: std::io::Error,
    },
}

/// The targets one configured router URL stands for.
pub async fn resolve(url: &str) -> Result<Vec<RouterTarget>, ResolveError> {
    let parsed = Url::parse(url).map_err(|_| ResolveError::NoHost(url.to_owned()))?;
    let host = parsed.host_str().ok_or_else(|| ResolveError::NoHost(url.to_owned()))?;
    // An IP literal (v6 in brackets) is its own single target.
    if host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().is_ok() {
        return Ok(vec![target(&parsed)]);
    }
    let port = parsed.port_or_known_default().unwrap_or(80);
    let addrs = tokio::net::lookup_host((host, port))
        .await
        .map_err(|source| ResolveError::Lookup { url: url.to_owned(), source })?;
    let mut out: Vec<RouterTarget> = addrs
        .filter_map(|addr| {
            let mut u = parsed.clone();
            u.set_ip_host(addr.ip()).ok()?;
            Some(target(&u))
        })
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

fn target(url: &Url) -> RouterTarget {
    RouterTarget(url.as_str().trim_end_matches('/').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn literals_and_names() {
        assert_eq!(resolve("http://127.0.0.1:8080").await.unwrap(), vec![RouterTarget("http://127.0.0.1:8080".into())]);
        assert_eq!(resolve("http://[::1]:8080/").await.unwrap(), vec![RouterTarget("http://[::1]:8080".into())]);
        let local = resolve("http://localhost:8080").await.unwrap();
        assert!(!local.is_empty());
        assert!(local.iter().all(|t| !t.0.contains("localhost")), "{local:?}");
    }
}
