#!/usr/bin/env bash
# Chat smoke test: serve the newest trained model (sft > mid > base) with scripts.chat_web on a
# free 127.0.0.1 port, send one POST /v1/chat/completions, and fail unless a non-empty answer
# comes back. The server is stopped (by its pid) whatever happens.
#
#   .ci/chat_smoke.sh [--model-tag d2] [--source auto|sft|mid|base] [--timeout 180]
# Uses $NANOCHAT_BASE_DIR (default ~/.cache/nanochat) and the repo's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=d2 SOURCE=auto TIMEOUT=180
die() { echo "chat_smoke: error: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model-tag) [[ $# -ge 2 ]] || die "--model-tag needs a value"; TAG="$2"; shift 2 ;;
    --source) [[ $# -ge 2 ]] || die "--source needs a value"; SOURCE="$2"; shift 2 ;;
    --timeout) [[ $# -ge 2 ]] || die "--timeout needs a value"; TIMEOUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1'; accepted: --model-tag TAG, --source auto|sft|mid|base, --timeout SECONDS" ;;
  esac
done
case "$SOURCE" in auto|sft|mid|base) ;; *) die "--source: got '$SOURCE'; accepted: auto|sft|mid|base" ;; esac
[[ "$TIMEOUT" =~ ^[0-9]+$ && "$TIMEOUT" -ge 1 ]] || die "--timeout: got '$TIMEOUT'; accepted: an integer >= 1 (seconds)"

BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
PY=.venv/bin/python
if [[ "$SOURCE" == auto ]]; then
  for phase in sft mid base; do
    if [[ -d "$BASE_DIR/checkpoints/$phase/$TAG" ]]; then SOURCE=$phase; break; fi
  done
  [[ "$SOURCE" != auto ]] || die "no checkpoint for tag '$TAG' under $BASE_DIR/checkpoints/{sft,mid,base}"
fi
PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
LOG="$(mktemp -t chat_smoke.XXXXXX.log)"
echo "chat_smoke: serving $SOURCE/$TAG on 127.0.0.1:$PORT (log $LOG)"
t0=$SECONDS
"$PY" -m scripts.chat_web -i "$SOURCE" --model-tag "$TAG" --device cpu --host 127.0.0.1 --port "$PORT" \
  --log-level warning > "$LOG" 2>&1 &
SERVER=$!
cleanup() {
  if kill -0 "$SERVER" 2>/dev/null; then
    kill -TERM "$SERVER" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER" 2>/dev/null || true
  fi
  wait "$SERVER" 2>/dev/null || true
}
trap cleanup EXIT

until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
  if ! kill -0 "$SERVER" 2>/dev/null; then cat "$LOG" >&2; die "chat_web exited before serving (log above)"; fi
  (( SECONDS - t0 < TIMEOUT )) || { cat "$LOG" >&2; die "chat_web not up after ${TIMEOUT} s"; }
  sleep 0.5
done
echo "chat_smoke: server up after $((SECONDS - t0)) s"

REPLY="$(curl -sS --max-time "$TIMEOUT" "http://127.0.0.1:$PORT/v1/chat/completions" \
  -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "Hello! Who are you?"}], "max_tokens": 32, "temperature": 0}')" \
  || { cat "$LOG" >&2; die "the request failed"; }
ANSWER="$(printf '%s' "$REPLY" | "$PY" -c '
import json, sys
reply = json.load(sys.stdin)
print(reply["choices"][0]["message"]["content"])')" || die "not an OpenAI chat completion: $REPLY"
[[ -n "${ANSWER//[[:space:]]/}" ]] || die "empty answer: $REPLY"
echo "chat_smoke: answered in $((SECONDS - t0)) s total: $(printf '%s' "$ANSWER" | head -c 200 | tr '\n' ' ')"
