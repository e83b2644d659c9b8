#!/bin/sh
# Entrypoint of a clawray Ray job (launch/submit.sh), run on the head node in the job's working dir (the
# shipped checkout): `clawray run ARGS` with the first Python that imports ray and torch, out of
# $CLAWRAY_PYTHON, python3, python (start Ray with the venv's bin on PATH, or pass CLAWRAY_PYTHON).
for py in "${CLAWRAY_PYTHON:-}" python3 python; do
  if [ -n "$py" ] && "$py" -c "import ray, torch" 2>/dev/null; then exec "$py" -m clawray.cli run "$@"; fi
done
echo "clawray job: no python with ray and torch on the head node (PATH=$PATH): start Ray with the venv's bin on PATH or set CLAWRAY_PYTHON" >&2
exit 127
