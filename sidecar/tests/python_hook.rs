//! Cross-language checks against libzmq (through pyzmq), the library vLLM's
//! publisher, replay endpoint and the `kvroute_hooks` plugin run on: the
//! sidecar's own ZMTP client (`kvroute_sidecar::zmtp`) subscribing and
//! replaying, and its snapshot client against the real `kvroute_hooks`
//! server (python-hooks/). Need a Python with pyzmq and msgpack
//! (`KVROUTE_PYTHON`, set by scripts/test.sh, else python3); fail saying so
//! when it has none.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvroute_sidecar::decode::{Seq, decode_message};
use kvroute_sidecar::replay;
use kvroute_sidecar::snapshot;
use kvroute_sidecar::zmtp::Subscription;

/// Runs `script` under a Python with pyzmq and msgpack, with `PYTHONPATH`,
/// and returns it with the first line it prints.
fn python(script: &str, pythonpath: Option<&str>) -> (Child, String) {
    // scripts/test.sh points KVROUTE_PYTHON at the test venv it installs.
    let python = std::env::var("KVROUTE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python).args(["-c", "import zmq, msgpack"]).status().is_ok_and(|s| s.success());
    assert!(ok, "{python} lacks pyzmq or msgpack: pip install pyzmq msgpack (scripts/test.sh installs them)");
    let mut cmd = Command::new(&python);
    cmd.args(["-c", script]).stdin(Stdio::piped()).stdout(Stdio::piped());
    if let Some(path) = pythonpath {
        cmd.env("PYTHONPATH", path);
    }
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    (child, line.trim().to_owned())
}

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
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/../python-hooks/src");
    let (mut child, endpoint) = python(SCRIPT, Some(src));
    assert!(endpoint.starts_with("tcp://127.0.0.1:"), "got {endpoint:?}");
    let held = snapshot::fetch(&endpoint, None).await.unwrap();
    let id = |b: u8| u64::from_be_bytes([b; 8]);
    assert_eq!(held, [id(1), id(2), id(255)].into_iter().collect());
    // Closing stdin ends the script.
    child.stdin.take().unwrap().flush().unwrap();
    child.wait().unwrap();
}

/// A PUB publishing `[topic, seq, payload]` as vLLM does (and another topic
/// beside it), and a ROUTER answering replays as vLLM's does.
const LIBZMQ_ENGINE: &str = r#"
import sys, threading, time
import msgpack, zmq

ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
router = ctx.socket(zmq.ROUTER)
router_port = router.bind_to_random_port("tcp://127.0.0.1")

def payload(seq):
    return msgpack.packb([1.7e9, [{"type": "AllBlocksCleared"}], 0])

def replay():
    while True:
        identity, _, start = router.recv_multipart()
        start = int.from_bytes(start, "big")
        for seq in range(start, 3):
            router.send_multipart([identity, b"", b"kv", seq.to_bytes(8, "big"), payload(seq)])
        router.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

threading.Thread(target=replay, daemon=True).start()
print(f"tcp://127.0.0.1:{pub_port} tcp://127.0.0.1:{router_port}", flush=True)

def publish():
    seq = 0
    while True:
        # Another topic first: the subscription must filter it out.
        pub.send_multipart([b"other", seq.to_bytes(8, "big"), payload(seq)])
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload(seq)])
        seq += 1
        time.sleep(0.01)

threading.Thread(target=publish, daemon=True).start()
sys.stdin.read()
"#;

#[tokio::test]
async fn the_zmtp_client_subscribes_and_replays_against_libzmq() {
    let (mut child, line) = python(LIBZMQ_ENGINE, None);
    let (events, replay_endpoint) = line.split_once(' ').unwrap_or_else(|| panic!("got {line:?}"));

    let mut sub = Subscription::open(events, "kv").await.unwrap();
    // A deadline for a broken build, not a wait: libzmq sends to a
    // subscriber as soon as it has read its subscription.
    let mut seqs = Vec::new();
    while seqs.len() < 3 {
        let frames = tokio::time::timeout(Duration::from_secs(30), sub.recv()).await.unwrap().unwrap();
        assert_eq!(frames[0].as_ref(), b"kv", "only the subscribed topic arrives");
        let (seq, batch) = decode_message(&frames).unwrap();
        assert_eq!(batch.events.len(), 1);
        seqs.push(seq.0);
    }
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "in order: {seqs:?}");

    let replayed = replay::fetch(replay_endpoint, Seq(1), Duration::from_secs(30)).await.unwrap();
    assert_eq!(replayed.iter().map(|(s, _)| s.0).collect::<Vec<_>>(), [1, 2]);

    child.kill().unwrap();
    child.wait().unwrap();
}
