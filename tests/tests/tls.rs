//! Sidecar → router pushes over TLS with a private CA: a sidecar given the CA
//! registers its worker; one without it cannot push.

use std::time::Duration;

use kvroute_sim::cluster::{LOCAL_TOKEN, Proc};
use kvroute_tests::{Client, ensure_built, eventually};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_push_over_tls_when_they_trust_the_ca() {
    let bin = ensure_built();
    let dir = std::env::temp_dir().join(format!("kvroute-e2e-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    let s = |p: &std::path::Path| p.display().to_string();

    let mut engine = Proc::spawn(
        "engine",
        &bin.join("kvroute-sim"),
        &["--listen", "127.0.0.1:0", "--kv-events-endpoint", "tcp://127.0.0.1:0"].map(String::from),
    )
    .await
    .unwrap();
    let engine_url = engine.announced("listening on ").await.unwrap();
    let events = engine.announced("kv-events on ").await.unwrap();
    let mut router = Proc::spawn(
        "router",
        &bin.join("kvroute-router"),
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--internal-token".into(),
            LOCAL_TOKEN.into(),
            "--tls-cert".into(),
            s(&cert),
            "--tls-key".into(),
            s(&key),
        ],
    )
    .await
    .unwrap();
    let router_url = router.announced("listening on ").await.unwrap();
    assert!(router_url.starts_with("https://"), "{router_url}");

    let sidecar = |id: &str, ca: Option<&std::path::Path>| {
        let mut args: Vec<String> = [
            "--worker-id",
            id,
            "--engine-url",
            &engine_url,
            "--events",
            &events,
            "--router",
            &router_url,
            "--internal-token",
            LOCAL_TOKEN,
            "--listen",
            "127.0.0.1:0",
            "--sync-interval",
            "1s",
        ]
        .map(String::from)
        .to_vec();
        if let Some(ca) = ca {
            args.extend(["--tls-ca".into(), s(ca)]);
        }
        args
    };
    let mut trusted =
        Proc::spawn("sidecar w1", &bin.join("kvroute-sidecar"), &sidecar("w1", Some(&cert))).await.unwrap();
    trusted.announced("listening on ").await.unwrap();
    let mut untrusted = Proc::spawn("sidecar w2", &bin.join("kvroute-sidecar"), &sidecar("w2", None)).await.unwrap();
    let untrusted_url = untrusted.announced("listening on ").await.unwrap();

    let https = Client {
        http: reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(ck.cert.pem().as_bytes()).unwrap())
            .build()
            .unwrap(),
    };
    eventually("w1 to register over TLS", WAIT, || {
        let (c, r) = (https.clone(), router_url.clone());
        async move {
            let v = c.get(&format!("{r}/admin/workers")).await;
            v["workers"].as_array().unwrap().iter().any(|w| w["id"] == "w1").then_some(())
        }
    })
    .await;
    eventually("w2's pushes to fail", WAIT, || {
        let (c, u) = (Client::default(), untrusted_url.clone());
        async move {
            let text = c.http.get(format!("{u}/metrics")).send().await.ok()?.text().await.ok()?;
            text.lines()
                .any(|l| l.starts_with("kvroute_sidecar_push_failures_total") && !l.ends_with(" 0"))
                .then_some(())
        }
    })
    .await;
    let v = https.get(&format!("{router_url}/admin/workers")).await;
    assert!(!v["workers"].as_array().unwrap().iter().any(|w| w["id"] == "w2"), "w2 must not register: {v}");
    for p in [&mut untrusted, &mut trusted, &mut router, &mut engine] {
        p.kill().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}
