#!/usr/bin/env bash
# Screenshots of the built site as a 1280 x 900 browser window shows it, opened from file://:
#   make docs && bash docs/screenshots.sh [SITE_DIR]       # writes docs/images/screenshot_*.png
# It first checks every page at that width (docs/layout_check.py: formulas rendered, no formula or table wider than
# its column, the CJK font loaded) and stops on a problem. Headless chromium (Debian: apt-get install chromium). For a part further down a page (a figure, an argument table),
# a copy of the page drops what comes before it (headless chromium paints nothing when started scrolled down).
set -eu
SITE=$(realpath "${1:-site}")
OUT=$(realpath "$(dirname "$0")/images")
python3 "$(dirname "$0")/layout_check.py" "$SITE"
shot() {  # page, output
  chromium --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$(mktemp -d)" --hide-scrollbars \
    --virtual-time-budget=8000 --screenshot="$2" --window-size=1280,900 "file://$SITE/$1" >/dev/null 2>&1
}
shot_from() {  # page, CSS selector of the first element to show, output
  local copy
  copy="$(dirname "$1")/_screenshot_$(basename "$1")"
  python3 - "$SITE/$1" "$SITE/$copy" "$2" <<'PY'
import sys
source, copy, selector = sys.argv[1:]
script = """<script>addEventListener("DOMContentLoaded", () => {
  for (let node = document.querySelector('%s'); node && !node.classList.contains("md-content__inner");
       node = node.parentElement)
    while (node.previousElementSibling && node.previousElementSibling.tagName !== "H1")
      node.previousElementSibling.remove();
});</script></body>""" % selector
open(copy, "w", encoding="utf-8").write(open(source, encoding="utf-8").read().replace("</body>", script))
PY
  shot "$copy" "$3"
  rm "$SITE/$copy"
}
shot index.html "$OUT/screenshot_home.png"
shot api.html "$OUT/screenshot_api.png"
shot_from semantics/masks.html 'img[src*=mask_modes]' "$OUT/screenshot_semantics_masks.png"
shot_from api.html '.doc-function' "$OUT/screenshot_api_arguments.png"
shot operators/flash_attention_score.html "$OUT/flash_attention_score.png"
shot semantics/precision.html "$OUT/screenshot_precision.png"
shot operators/fused_infer_attention_score.html "$OUT/screenshot_fused_infer_attention_score.png"
shot_from api.html '[id="cann_attn.fused_infer_attention_score"] ~ .doc-contents table' "$OUT/screenshot_api_fused_infer_attention_score.png"
