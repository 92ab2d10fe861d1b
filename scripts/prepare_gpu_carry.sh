#!/usr/bin/env bash
# Prepare what a call to the lent H200 carries beside the working tree: .whl (Python 3.12 wheels
# of the web stack, which that machine lacks; ignored by git, see .git/info/exclude). The golden
# data is in the checkout (tests/golden) and travels with it.
# Then: device run with carry [".whl"] (scripts/gpu_serve_bench.sh; scripts/gpu_run.sh needs none).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF /.whl/ .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux_2_26_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 uvicorn==0.54.0 python-multipart==0.0.34 ormsgpack==1.13.1 av==18.1.0 \
  SQLAlchemy==2.1.9 websockets==17.4 pyzmq==27.3.0 opentelemetry-api==1.45.2 typing_extensions==4.16.0 anyio==4.16.0 annotated-doc==0.0.7 \
  py-spy==0.4.3  # not a server dependency: probe_server_load.py --py-spy, gpu_serve_bench.sh PYSPY_S
du -sh .whl
