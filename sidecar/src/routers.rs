//! Router addresses: each configured URL stands for every address its host
//! resolves to (a headless Kubernetes service lists all router replicas), so
//! every replica gets every push. Re-resolved at every sync.

use kvroute_shared::resolve::{RESOLVE_TIMEOUT, ResolveError};

use crate::state::RouterTarget;

/// The targets one configured router URL stands for (the lookup runs on the
/// blocking pool, waited for at most [`RESOLVE_TIMEOUT`]).
pub async fn resolve(url: &str) -> Result<Vec<RouterTarget>, ResolveError> {
    let owned = url.to_owned();
    let lookup = tokio::task::spawn_blocking(move || kvroute_shared::resolve::resolve(&owned));
    let bases = match tokio::time::timeout(RESOLVE_TIMEOUT, lookup).await {
        Ok(joined) => {
            joined.map_err(|e| ResolveError::Lookup { url: url.to_owned(), source: std::io::Error::other(e) })??
        }
        Err(_) => return Err(ResolveError::TimedOut { url: url.to_owned(), after: RESOLVE_TIMEOUT }),
    };
    Ok(bases.into_iter().map(RouterTarget).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn targets_are_the_resolved_base_urls() {
        assert_eq!(
            resolve("http://127.0.0.1:8080/").await.unwrap(),
            vec![RouterTarget("http://127.0.0.1:8080".into())]
        );
        assert!(resolve("no url").await.is_err());
    }
}
