//! End-to-end tests of the proxy core; the tests live in `tests/tests/`.
