//! The methods every transport handle delegates word for word to its link table, written
//! once as macros: the table-only [`crate::Transport`] methods and the public
//! `connect`/`dial` pair. Each transport invokes them inside its own `impl` blocks.

/// Inside `impl Transport for T { ... }`: writes the methods every transport answers the
/// same way: `local_id`, `events`, `set_event_handler`, `listen_addr`, `is_connected` and
/// `stats` from the [`crate::LinkTable`], `shutdown` and `kill` as the transport's
/// `close_all` with and without goodbyes. `self.<inner>` (the field named) must have a
/// `links` field (the table) and a method `close_all(&self, goodbye: bool)`.
#[macro_export]
macro_rules! transport_link_methods {
    ($inner:ident) => {
        fn local_id(&self) -> $crate::NodeId {
            self.$inner.links.node()
        }

        fn events(&self) -> $crate::link::EventReceiver {
            self.$inner.links.events.receiver()
        }

        fn set_event_handler(&self, handler: $crate::EventHandler) -> bool {
            self.$inner.links.events.set_handler(handler)
        }

        fn listen_addr(&self) -> ::std::option::Option<::std::net::SocketAddr> {
            ::std::option::Option::Some(self.$inner.links.listen_addr())
        }

        fn is_connected(&self, peer: $crate::NodeId) -> bool {
            self.$inner.links.contains(peer)
        }

        fn dials_on_use(&self) -> bool {
            self.$inner.links.is_on_demand()
        }

        fn is_up(&self, peer: $crate::NodeId) -> bool {
            self.$inner.links.is_up(peer)
        }

        fn link_counts(&self) -> ::std::option::Option<$crate::LinkCounts> {
            ::std::option::Option::Some(self.$inner.links.link_counts())
        }

        fn stats(&self) -> $crate::TransportStats {
            self.$inner.links.counters.stats()
        }

        fn shutdown(&self) {
            self.$inner.close_all(true);
        }

        fn kill(&self) {
            self.$inner.close_all(false);
        }
    };
}

/// Inside `impl T { ... }` of a transport handle: writes the public `connect` and `dial`.
/// `self.<inner>` (the field named) must be an `Arc` of a type with a `links` field (the
/// [`crate::LinkTable`]), a `cfg.connect_timeout` and `cfg.startup_grace` (`Duration`s), a
/// `cfg.on_demand` (`bool`: links made on first use, see [`crate::LinkTable::link`]) and
/// a method
/// `dial(self: &Arc<Self>, peer, addr, deadline: Instant) -> Result<(), TransportError>`
/// that links one peer, trying until the deadline.
#[macro_export]
macro_rules! connect_methods {
    ($inner:ident) => {
        /// Connects to `peers`: dials those with a lower id (all of them with `dial_all`, as
        /// a restarted node does to rejoin) and waits until every peer is linked, up to the
        /// connect timeout. From then on a failed link to a lower id is dialled again. With
        /// `cfg.on_demand` it only learns where the peers listen (a rejoining node still
        /// dials them all): each link is made on its first use.
        pub fn connect(
            &self,
            peers: &[($crate::NodeId, ::std::net::SocketAddr)],
            dial_all: bool,
        ) -> ::std::result::Result<(), $crate::TransportError> {
            let inner = &self.$inner;
            let weak = ::std::sync::Arc::downgrade(inner);
            let redial: $crate::link::DialFn =
                ::std::sync::Arc::new(move |peer, addr, deadline| match weak.upgrade() {
                    ::std::option::Option::Some(i) => i.dial(peer, addr, deadline),
                    ::std::option::Option::None => {
                        ::std::result::Result::Err($crate::TransportError::Shutdown)
                    }
                });
            if inner.cfg.on_demand {
                inner
                    .links
                    .enable_on_demand(inner.cfg.startup_grace, $crate::link::DIAL_TIMEOUT);
            }
            inner.links.enable_redial(peers, redial)?;
            inner.links.connect_mesh(
                peers,
                dial_all,
                inner.cfg.connect_timeout,
                |peer, addr, deadline| inner.dial(peer, addr, deadline),
            )
        }

        /// Dials one peer now (for a peer that restarted and listens again).
        pub fn dial(
            &self,
            peer: $crate::NodeId,
            addr: ::std::net::SocketAddr,
            timeout: ::std::time::Duration,
        ) -> ::std::result::Result<(), $crate::TransportError> {
            self.$inner
                .dial(peer, addr, ::std::time::Instant::now() + timeout)
        }
    };
}
