//! Cross-language check: the sidecar's snapshot client against the real
//! `kvroute_hooks` server (python-hooks/), over ZMQ REQ/REP. Needs a Python
//! with pyzmq and msgpack (`KVROUTE_PYTHON`, set by scripts/test.sh, else
//! python3); fails saying so when it has none.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use kvroute_sidecar::snapshot;

const SCRIPT: &str = r#"
import sys
from kvroute_hooks import SnapshotServer, collect_hashes

class Map:
    def __init__(self):
        # BlockHashWithGroupId keys: a 32-byte digest + 4-byte group id.
        self._cache = {bytes([i]) * 32 + (0).to_bytes(4, "big"): object() for i in (1, 2, 255)}

class Pool:
    def __init__(self):
        self.cached_block_hash_to_block = Map()

pool = Pool()
# The first collection imports vLLM's hash helpers when vLLM is installed
# (seconds: it imports torch); inside an engine they are loaded already.
collect_hashes([pool])
server = SnapshotServer("tcp://127.0.0.1:0", lambda: collect_hashes([pool])).start()
print(server.endpoint, flush=True)
sys.stdin.read()
server.stop()
"#;

#[tokio::test]
async fn sidecar_reads_the_python_hooks_snapshot() {
    // scripts/test.sh points KVROUTE_PYTHON at the test venv it installs.
    let python = std::env::var("KVROUTE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python).args(["-c", "import zmq, msgpack"]).status().is_ok_and(|s| s.success());
    assert!(ok, "{python} lacks pyzmq or msgpack: pip install pyzmq msgpack (scripts/test.sh installs them)");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/../python-hooks/src");
    let mut child = Command::new(&python)
        .args(["-c", SCRIPT])
        .env("PYTHONPATH", src)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let endpoint = line.trim().to_owned();
    assert!(endpoint.starts_with("tcp://127.0.0.1:"), "got {line:?}");
    let held = snapshot::fetch(&endpoint).await.unwrap();
    let id = |b: u8| u64::from_be_bytes([b; 8]);
    assert_eq!(held, [id(1), id(2), id(255)].into_iter().collect());
    // Closing stdin ends the script.
    child.stdin.take().unwrap().flush().unwrap();
    child.wait().unwrap();
}
