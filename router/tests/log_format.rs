//! `--log-format json`: every log line the router writes is one JSON object
//! (what log shippers parse), and the peer spellings `--host`/`--port` bind.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

// Its in-process router is not used here: only `refused_url`.
#[allow(dead_code)]
mod support;

/// The lines of `out` that contain `needle`, as they come (read on a thread
/// of their own).
fn lines_containing(out: impl BufRead + Send + 'static, needle: &'static str) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            if line.contains(needle) && tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// The router binary with `args`, its log on stdout at the default level.
fn router(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kvroute-router"))
        .args(args)
        .env_remove("KVROUTE_LOG")
        .env_remove("KVROUTE_LOG_FORMAT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn json_logs_are_one_object_per_line_and_host_port_bind() {
    let mut child = router(&["--host", "127.0.0.1", "--port", "0", "--log-format", "json"]);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with("listening on http://127.0.0.1:"), "{line:?}");
    // Without --tokenizer the router logs its start and a warning at once.
    let mut levels = Vec::new();
    for _ in 0..2 {
        line.clear();
        out.read_line(&mut line).unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        levels.push(v["level"].as_str().unwrap_or_default().to_owned());
        assert!(v["fields"]["message"].is_string(), "{v}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(levels, ["INFO", "WARN"]);
}

#[test]
fn an_unknown_log_format_is_one_readable_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute-router")).args(["--log-format", "xml"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("possible values: text, json"), "{err}");
}

/// An ejection by failed probes names the URL probed and what the last
/// probe got: a worker at an address this router cannot reach said only
/// "health probes failed".
#[test]
fn an_ejection_names_the_url_probed_and_the_failure() {
    // Nothing listens there: a port the OS gave, bound, not listening.
    let gone = support::refused_url();
    let worker = format!("w={}", gone.url);
    let mut child = router(&["--listen", "127.0.0.1:0", "--worker", &worker, "--health-check-interval", "50ms"]);
    let out = BufReader::new(child.stdout.take().unwrap());
    let rx = lines_containing(out, "worker ejected");
    let line = rx.recv_timeout(std::time::Duration::from_secs(60));
    child.kill().unwrap();
    child.wait().unwrap();
    let line = line.expect("an ejection logged");
    assert!(line.contains(&format!("{}/health", gone.url)), "{line}");
    assert!(line.contains("the last:"), "{line}");
}

/// Workers are reached directly, whatever the proxy variables say: a host's
/// `HTTP_PROXY`, not excluded for pod addresses, sent the probes and
/// prompts through the proxy.
#[test]
fn workers_are_reached_directly_whatever_the_proxy_variables_say() {
    let worker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    for (name, listener) in [("worker", worker.try_clone().unwrap()), ("proxy", proxy.try_clone().unwrap())] {
        let tx = tx.clone();
        // Each answers nothing: which one the first probe reaches is all.
        std::thread::spawn(move || {
            if listener.accept().is_ok() {
                let _ = tx.send(name);
            }
        });
    }
    let proxy_url = format!("http://{}", proxy.local_addr().unwrap());
    let worker_arg = format!("w=http://{}", worker.local_addr().unwrap());
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-router"))
        .args(["--listen", "127.0.0.1:0", "--worker", &worker_arg, "--health-check-interval", "50ms"])
        .envs(["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"].map(|k| (k, &proxy_url)))
        .env_remove("NO_PROXY")
        .env_remove("no_proxy")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let first = rx.recv_timeout(std::time::Duration::from_secs(60));
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(first, Ok("worker"));
}

/// A failed attempt is logged once, naming the worker and the client's
/// request id (which vLLM takes as its own): a 502 left nothing but a
/// counter to match it with the engine's log.
#[test]
fn a_failed_attempt_is_logged_with_the_worker_and_the_request_id() {
    use std::io::{Read, Write};
    // An engine that answers every request 500, and closes.
    let engine = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let worker = format!("w-bad=http://{}", engine.local_addr().unwrap());
    std::thread::spawn(move || {
        for mut conn in engine.incoming().map_while(Result::ok) {
            let mut head = [0u8; 4096];
            let _ = conn.read(&mut head);
            let _ = conn
                .write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\nconnection: close\r\n\r\nboom");
        }
    });
    let mut child = router(&["--listen", "127.0.0.1:0", "--worker", &worker, "--health-check-interval", "1h"]);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("{line:?}")).to_owned();
    let rx = lines_containing(out, "attempt failed");
    let body = r#"{"model": "m", "prompt": "hello"}"#;
    let mut conn = std::net::TcpStream::connect(addr.trim_start_matches("http://")).unwrap();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\nx-request-id: req-7f3a\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
    let line = rx.recv_timeout(std::time::Duration::from_secs(60));
    child.kill().unwrap();
    child.wait().unwrap();
    let line = line.expect("the failed attempt logged");
    for part in ["w-bad", "req-7f3a", "500"] {
        assert!(line.contains(part), "{part} not in {line}");
    }
}

/// A first stop signal drains (`/ready` says so); a second ends the process
/// at once, exit code 130: it waited out `drain_delay` and `shutdown_grace`
/// whatever the operator pressed.
#[test]
fn a_second_stop_signal_ends_the_router_at_once() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-router"))
        .args(["--listen", "127.0.0.1:0"])
        .env("KVROUTE_DRAIN_DELAY", "1h")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("listening on http://").unwrap_or_else(|| panic!("{line:?}")).to_owned();
    let signal = |pid: u32| {
        let sent = Command::new("kill").args(["-INT", &pid.to_string()]).status().unwrap();
        assert!(sent.success());
    };
    signal(child.id());
    // Signals of one kind pending together are one: the second is sent once
    // the first is seen, by /ready.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(&addr).unwrap();
        conn.write_all(b"GET /ready HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n").unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        if answer.contains("\"draining\":true") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never draining: {answer}");
        std::thread::yield_now();
    }
    signal(child.id());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait().unwrap());
    });
    let status = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the router exited");
    assert_eq!(status.code(), Some(130));
}

/// A worker without a sidecar whose engine's cache is not the router's is
/// an error in the log, naming both block sizes, and prefix caching off
/// too: a sidecar refuses both at its start, and a static worker was routed
/// on, in silence, with keys that were not its blocks.
#[test]
fn a_static_workers_other_block_size_and_prefix_caching_off_are_logged() {
    use std::io::{Read, Write};
    let engine = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let worker = format!("w-32=http://{}", engine.local_addr().unwrap());
    std::thread::spawn(move || {
        let page =
            "vllm:cache_config_info{block_size=\"32\",enable_prefix_caching=\"False\",num_gpu_blocks=\"900\"} 1.0\n";
        for mut conn in engine.incoming().map_while(Result::ok) {
            let mut head = [0u8; 4096];
            let n = conn.read(&mut head).unwrap_or(0);
            let body = if head[..n].starts_with(b"GET /metrics ") { page } else { "{}" };
            let answer =
                format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
            let _ = conn.write_all(answer.as_bytes());
        }
    });
    let mut child = router(&["--listen", "127.0.0.1:0", "--worker", &worker, "--health-check-interval", "50ms"]);
    let out = BufReader::new(child.stdout.take().unwrap());
    let rx = lines_containing(out, "ERROR");
    let errors: Vec<String> = (0..2).map_while(|_| rx.recv_timeout(std::time::Duration::from_secs(60)).ok()).collect();
    child.kill().unwrap();
    child.wait().unwrap();
    let block_size = errors.iter().find(|l| l.contains("block size")).unwrap_or_else(|| panic!("{errors:?}"));
    assert!(block_size.contains("engine_block_size=32") && block_size.contains("w-32"), "{block_size}");
    assert!(errors.iter().any(|l| l.contains("without prefix caching")), "{errors:?}");
}
