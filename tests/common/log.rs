//! Traces of a test's nodes on demand: `PHALANX_TEST_LOG=phalanx=debug cargo test ...` prints
//! them to stderr (to chase a rare failure); without it, nothing.

/// Installs the stderr subscriber once, if `PHALANX_TEST_LOG` names a filter.
pub fn from_env() {
    if let Ok(filter) = std::env::var("PHALANX_TEST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    }
}
