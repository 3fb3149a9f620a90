//! Base URLs that stand for every address their host resolves to: a
//! headless Kubernetes service lists every router replica, so a sidecar
//! pushes to each one and a router exchanges with each of its replicas.
//! Both re-resolve periodically, so replicas that come and go are followed.
//!
//! The lookup blocks (the system resolver, as `tokio::net::lookup_host`
//! uses too): async callers run it on their blocking pool.

use std::net::{IpAddr, ToSocketAddrs};

use url::Url;

/// Why a base URL could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("URL {0:?} has no host")]
    NoHost(String),
    #[error("cannot resolve the host of {url}")]
    Lookup {
        url: String,
        #[source]
        source: std::io::Error,
    },
}

/// The base URLs (no trailing `/`, an IP address for the host) that `url`
/// stands for, sorted and without duplicates. An IP literal is its own
/// single address.
pub fn resolve(url: &str) -> Result<Vec<String>, ResolveError> {
    let parsed = Url::parse(url).map_err(|_| ResolveError::NoHost(url.to_owned()))?;
    let host = parsed.host_str().ok_or_else(|| ResolveError::NoHost(url.to_owned()))?;
    // An IP literal (v6 in brackets) is its own single target.
    if host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().is_ok() {
        return Ok(vec![base(&parsed)]);
    }
    let port = parsed.port_or_known_default().unwrap_or(80);
    let addrs =
        (host, port).to_socket_addrs().map_err(|source| ResolveError::Lookup { url: url.to_owned(), source })?;
    let mut out: Vec<String> = addrs
        .filter_map(|addr| {
            let mut u = parsed.clone();
            u.set_ip_host(addr.ip()).ok()?;
            Some(base(&u))
        })
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

fn base(url: &Url) -> String {
    url.as_str().trim_end_matches('/').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_and_names() {
        assert_eq!(resolve("http://127.0.0.1:8080").unwrap(), ["http://127.0.0.1:8080"]);
        assert_eq!(resolve("http://[::1]:8080/").unwrap(), ["http://[::1]:8080"]);
        let local = resolve("http://localhost:8080").unwrap();
        assert!(!local.is_empty());
        assert!(local.iter().all(|t| !t.contains("localhost")), "{local:?}");
        assert!(matches!(resolve("not a url"), Err(ResolveError::NoHost(_))));
    }
}
