#!/usr/bin/env python3
"""Real text-to-speech behind the ``cmd:`` runner: espeak-ng (a Debian package).

Install it with ``apt-get install espeak-ng``. Run it as:

    GPUHEDGE_RUNNER='cmd:python3 /opt/gpuhedge/espeak_tts.py'

The request on stdin is ``{"text": "..."}`` (or a JSON string); stdout is the WAV as base64 text,
which is what the ``wav`` validator reads, so a pooled GPU running it can be the target of a
hedged race whose providers return audio (``validator: wav``). espeak-ng runs on the CPU: it
stands in for a GPU text-to-speech model with the same protocol. A failure is a non-zero exit
with one line on stderr, as the ``cmd:`` runner expects.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile

MAX_CHARS = 2000


def main() -> int:
    try:
        request = json.load(sys.stdin)
    except ValueError as e:
        print(f"espeak_tts: the request on stdin is not JSON: {e}", file=sys.stderr)
        return 2
    text = request.get("text") if isinstance(request, dict) else request
    if not isinstance(text, str) or not text.strip():
        print('espeak_tts: expected {"text": "..."} with some text', file=sys.stderr)
        return 2
    binary = shutil.which("espeak-ng")
    if binary is None:
        print("espeak_tts: espeak-ng is not installed (apt-get install espeak-ng)", file=sys.stderr)
        return 3
    voice = request.get("voice", "en") if isinstance(request, dict) else "en"
    fd, path = tempfile.mkstemp(suffix=".wav")
    os.close(fd)
    try:
        done = subprocess.run(
            [binary, "-v", str(voice), "-w", path, "--", text[:MAX_CHARS]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no stderr"])[-1]
            print(f"espeak_tts: espeak-ng exited with {done.returncode}: {tail}", file=sys.stderr)
            return 1
        with open(path, "rb") as f:
            sys.stdout.write(base64.b64encode(f.read()).decode("ascii"))
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
