"""What the tests and the benchmarks share: daemons and mounts (`mounts`), the
in-process layer's hosts (`inprocess`), a real GCS server (`gcs_server`), an
in-memory Kubernetes API server (`k8s_api`), a TCP link that can be cut or slowed
(`link_proxy`), hosts in network namespaces (`netns`), a tiny pyfuse3 passthrough
file system (`passthrough_fs`) and the chaos runner (`chaos`, `chaos_io`).
Imported as `support.<module>` with tests/ on sys.path (pytest puts it there for
tests/conftest.py; bench/ adds it)."""
