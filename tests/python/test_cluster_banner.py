"""`kvroute-sim cluster` prints every process it started, with its metrics URL,
and each of those answers with Prometheus text (issue 15)."""
import urllib.request


def test_banner_lists_every_process_and_its_metrics_answer(cluster_banner):
    kinds = [line.split()[0] for line in cluster_banner]
    assert kinds.count("router") == 1 and kinds.count("engine") == 2 and kinds.count("sidecar") == 2, cluster_banner
    for line in cluster_banner:
        metrics = line.split("metrics ", 1)[1].split()[0]
        with urllib.request.urlopen(metrics, timeout=10) as r:
            text = r.read().decode()
        assert r.status == 200 and "# TYPE" in text, (line, text[:200])
