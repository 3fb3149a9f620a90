//! Base URLs that stand for every address their host resolves to: a
//! headless Kubernetes service lists every router replica, so a sidecar
//! pushes to each one and a router exchanges with each of its replicas.
//! Both re-resolve periodically, so replicas that come and go are followed.
//!
//! The lookup blocks (the system resolver, as `tokio::net::lookup_host`
//! uses too): async callers run it on their blocking pool.

use std::net::{IpAddr, ToSocketAddrs};
use std::time::Duration;

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
    #[error("no answer resolving the host of {url} within {after:?}")]
    TimedOut { url: String, after: Duration },
}

/// How long an async caller waits for one lookup: `getaddrinfo` has no
/// timeout of its own (a resolver outage with search domains blocks for tens
/// of seconds), and the loops that re-resolve also forget silent replicas
/// and run the engine snapshots.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// The base URLs (no trailing `/`, an IP address for the host) that `url`
/// stands for, sorted and without duplicates. An IP literal is its own
/// single address. A name's addresses are those of one family (see
/// [`one_family`]).
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
    let ips: Vec<IpAddr> = addrs.map(|a| a.ip()).collect();
    let mut out: Vec<String> = one_family(&ips)
        .filter_map(|ip| {
            let mut u = parsed.clone();
            u.set_ip_host(ip).ok()?;
            Some(base(&u))
        })
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// A dual-stack name lists every host twice, once per family (`localhost`
/// is `127.0.0.1` and `::1`; a dual-stack headless service has each pod's
/// v4 and v6 address), and nothing says which two addresses are one host.
/// Taken both, every router would get every push twice, over two links
/// sharing one seq counter, and a router would exchange with each replica
/// twice. So a name stands for its IPv4 addresses when it has any, and for
/// its IPv6 addresses otherwise: IPv4 reaches a server listening on
/// `0.0.0.0` and one on `[::]` (dual-stack sockets, Linux's default), where
/// IPv6 reaches only the latter. A server reachable only over IPv6 is named
/// by an IPv6 literal or by a name with only IPv6 addresses.
pub fn one_family(ips: &[IpAddr]) -> impl Iterator<Item = IpAddr> + '_ {
    let v4 = ips.iter().any(IpAddr::is_ipv4);
    ips.iter().copied().filter(move |ip| ip.is_ipv4() == v4)
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

    #[test]
    fn a_dual_stack_name_stands_for_one_family() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let dual = [ip("::1"), ip("127.0.0.1"), ip("fd00::7"), ip("10.0.0.7")];
        assert_eq!(one_family(&dual).collect::<Vec<_>>(), [ip("127.0.0.1"), ip("10.0.0.7")]);
        let v6 = [ip("fd00::7"), ip("fd00::8")];
        assert_eq!(one_family(&v6).collect::<Vec<_>>(), v6);
        // localhost is both on most machines: one target, not two.
        assert_eq!(resolve("http://localhost:8080").unwrap().len(), 1);
    }
}
