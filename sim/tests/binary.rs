//! The binary's discovery contract: started with port 0 everywhere, it prints
//! `listening on http://ADDR`, `kv-events on tcp://…` and `kv-replay on tcp://…`
//! on stdout, and the printed address answers `/health`.

use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

#[tokio::test]
async fn prints_bound_addresses_on_stdout() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .args(["--listen", "127.0.0.1:0", "--instant", "--model", "m"])
        .args(["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn kvroute-sim");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut got = Vec::new();
    while got.len() < 3 {
        let line = lines.next_line().await.expect("read").expect("the simulator exited early");
        got.push(line);
    }
    let url = got[0].strip_prefix("listening on ").expect("listen line");
    assert!(url.starts_with("http://127.0.0.1:") && !url.ends_with(":0"), "{url}");
    let events = got[1].strip_prefix("kv-events on ").expect("events line");
    let replay = got[2].strip_prefix("kv-replay on ").expect("replay line");
    assert!(events.starts_with("tcp://127.0.0.1:") && replay.starts_with("tcp://127.0.0.1:"));
    assert_ne!(events, replay);
    let health = reqwest::get(format!("{url}/health")).await.expect("health");
    assert!(health.status().is_success());
    let info: serde_json::Value =
        reqwest::get(format!("{url}/sim/info")).await.expect("info").json().await.expect("json");
    assert_eq!(info["kv_events"], events);
    assert_eq!(info["kv_replay"], replay);
    child.kill().await.expect("kill");
}
