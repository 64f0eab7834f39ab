# mtcfs: `make demo` and `make test` work on a fresh Debian machine as root.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: bootstrap demo test test-nofuse image soak-orbax chaos bench lint proto clean fuzz

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	$(VENV)/bin/mtcfs demo

# Most tests wait (daemons starting, timeouts, peers), so they run on TEST_WORKERS
# pytest-xdist workers, slowest first (tests/conftest.py); those marked `serial`
# (timing bounds that must not share the machine) run after them, one at a time.
TEST_WORKERS ?= 4

test: bootstrap
	$(PY) -m ruff check mtcfs tests bench fuzz
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 \
		-m 'not image and not chaos and not serial' tests
	$(PY) -m pytest -q -m 'serial and not image and not chaos' tests

# The container image mtcfs:<version> (deploy/Dockerfile) built with buildah from a
# debootstrapped Debian trixie base (scripts/build_image.sh: installs buildah and
# debootstrap, keeps the base and the build's layers between runs), then its smoke
# tests (tests/test_image.py).
image: bootstrap
	scripts/build_image.sh
	$(PY) -m pytest -q -m image tests/test_image.py

# The in-process layer alone (no FUSE, no /dev/fuse needed): seconds.
test-nofuse: bootstrap
	$(PY) -m pytest -q -m nofuse tests/nofuse

# The multi-host Orbax save/restore (processes swapped) on freshly started mounts,
# 50 times in a row (make test runs it twice).
soak-orbax: bootstrap
	MTCFS_ORBAX_ROUNDS=50 $(PY) -m pytest -q -p no:cacheprovider \
		"tests/test_commit_safety.py::test_orbax_multihost_save_then_restore_swapped_on_fresh_mounts"

# The chaos suite (tests/support/chaos.py): a training loop on three network-namespace hosts
# with a bucket while daemons are killed, replaced, frozen and cut off and the GCS
# server is frozen and restarted; then every committed step is read back through
# every host and from the bucket. Needs root. `make test` runs a short smoke of it.
CHAOS_MINUTES ?= 5
CHAOS_SEED ?= 1
CHAOS_FSYNC ?= local
CHAOS_ARGS ?=

chaos: bootstrap
	$(PY) tests/support/chaos.py --minutes $(CHAOS_MINUTES) --seed $(CHAOS_SEED) \
		--fsync $(CHAOS_FSYNC) $(CHAOS_ARGS)

bench: bootstrap
	$(PY) bench/run.py

# The peer protocols fuzzed with coverage guidance (atheris): gRPC calls with and
# without the token, the index's apply, membership datagrams, the data channel's
# handshake and frames, each FUZZ_SECONDS against an in-process daemon (fuzz/).
# Seeds: fuzz/corpus/<target>; new inputs and any crash-* go to FUZZ_WORK/<target>.
FUZZ_SECONDS ?= 300
FUZZ_TARGETS ?= grpc grpc-token index gossip bulk bulk-encrypted
FUZZ_WORK ?= /tmp/mtcfs-fuzz

fuzz: bootstrap
	@set -e; for t in $(FUZZ_TARGETS); do mkdir -p $(FUZZ_WORK)/$$t; \
		rc=0; $(PY) -m fuzz.run $$t -max_total_time=$(FUZZ_SECONDS) \
			-artifact_prefix=$(FUZZ_WORK)/$$t/ $(FUZZ_WORK)/$$t fuzz/corpus/$$t \
			> $(FUZZ_WORK)/$$t.log 2>&1 || rc=$$?; \
		runs=$$(grep -o 'Done [0-9]* runs in [0-9]* second' $(FUZZ_WORK)/$$t.log || true); \
		found=$$(ls $(FUZZ_WORK)/$$t | grep -c '^\(crash\|timeout\|oom\)-' || true); \
		echo "fuzz $$t: $$runs(s), $$found finding(s) (log: $(FUZZ_WORK)/$$t.log)"; \
		test $$rc = 0 || { echo "fuzz $$t: failed, see its log" >&2; exit 1; }; \
	done

lint: bootstrap
	$(PY) -m ruff check mtcfs tests bench fuzz
	$(PY) -m ruff format --check mtcfs tests bench

# The peer protocol's and the CSI subset's Python code is generated from proto/
# and checked in (tests/test_proto.py fails when it is stale). The CSI proto keeps
# the spec's package (csi.v1) and is mapped onto mtcfs/csi/v1 for the imports.
proto: bootstrap
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
		proto/mtcfs/peer/v1/peer.proto
	$(PY) -m grpc_tools.protoc -Imtcfs/csi/v1=proto/csi/v1 --python_out=. --pyi_out=. \
		--grpc_python_out=. proto/csi/v1/csi.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
