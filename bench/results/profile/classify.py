import sys, re, collections
def stage(stack):
    s = stack
    rules = [
        ("render (minijinja)", ["minijinja"]),
        ("tokenize: segment cache lookup/hash", ["Generations>::get", "Generations>::insert", "SegmentCache>::chunk"], ),
        ("tokenize: HF encode", ["tokenizers::"]),
        ("tokenize: chunking/added-token split", ["SegmentCache", "aho_corasick", "line_chunks"]),
        ("hash (block keys)", ["block_keys", "sha2"]),
        ("body parse (serde_json)", ["PromptRequest>::parse", "openai::PromptRequest", "serde_json"]),
        ("match + decide", ["routing::plan", "plan_against", "policy::", "match_depths", "record_routed"]),
        ("malloc_trim / memory", ["malloc_trim"]),
        ("forward: reqwest/hyper client", ["reqwest::", "hyper_util::client", "hyper::client", "hyper::proto::h1::dispatch::Client"]),
        ("serve: hyper server / axum", ["hyper::server", "axum::", "hyper::proto", "hyper_util::server"]),
        ("metrics", ["prometheus_client", "metrics::"]),
        ("tokio runtime / scheduling", ["tokio::"]),
    ]
    for name, pats in rules:
        if any(p in s for p in pats):
            return name
    return "other"
tot = collections.Counter(); leaf = collections.Counter()
for line in open(sys.argv[1]):
    stack, n = line.rstrip().rsplit(" ", 1); n = int(n)
    tot[stage(stack)] += n
    leaf[stack.split(";")[-1][:110]] += n
T = sum(tot.values())
for k, v in tot.most_common(): print(f"{v/T*100:5.1f}%  {k}")
print("--- top leaves")
for k, v in leaf.most_common(25): print(f"{v/T*100:5.1f}%  {k}")
