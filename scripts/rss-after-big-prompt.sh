#!/usr/bin/env bash
# Measures the router's resident memory before and after three 6.4 MB prompts
# to /debug/route (issue 13, finding 3: memory is returned after such a
# request). Figures in BENCHMARKS.md.
#
#   scripts/rss-after-big-prompt.sh target/release/kvroute-router
set -euo pipefail
BIN=${1:?usage: $0 ROUTER_BINARY}
TOK=${KVROUTE_TOKENIZER:-$(dirname "$0")/../../shared/testdata/tokenizers/gpt2}
CONF=$(mktemp)
printf 'max_prompt_tokens = 10000000\n' > "$CONF"
PORT=$((20000 + RANDOM % 10000))
$BIN --listen 127.0.0.1:$PORT --tokenizer "$TOK" --worker w1=http://127.0.0.1:9 --config "$CONF" --max-body-bytes 67108864 > /dev/null 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; rm -f "$CONF" "$CONF.json"' EXIT
for i in $(seq 50); do curl -s 127.0.0.1:$PORT/health >/dev/null && break; sleep 0.1; done
rss() { awk '/VmRSS/{print $2/1024 " MB"}' /proc/$PID/status; }
echo "idle: $(rss)"
python3 -c "
import json,random
random.seed(1)
words=['alpha','beta','gamma','delta','router','cache','token','prefix','engine','worker']
text=' '.join(random.choice(words)+str(random.randint(0,999)) for _ in range(700000))
json.dump({'model':'m','prompt':text},open('$CONF.json','w'))"
ls -la $CONF.json | awk '{print "body bytes: "$5}'
for i in 1 2 3; do curl -s -o /dev/null -w "debug/route %{http_code} %{time_total}s\n" -X POST 127.0.0.1:$PORT/debug/route -H 'content-type: application/json' --data-binary @$CONF.json; echo "after $i: $(rss)"; done
sleep 2; echo "2 s later: $(rss)"
