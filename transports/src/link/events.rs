//! Where a transport's events go: the handler if one is set, else the channel.

use crate::{Event, EventHandler};
use crossbeam_channel::{Receiver, Sender};
use std::sync::OnceLock;

/// The receiving end of a transport's event channel.
pub type EventReceiver = Receiver<Event>;

/// The event outlet of one transport, behind [`crate::Transport::events`] and
/// [`crate::Transport::set_event_handler`].
///
/// Contract: until a handler is set, events queue in an unbounded channel that
/// [`EventSink::receiver`] hands out; [`EventSink::set_handler`] succeeds once, first passes
/// every queued event to the handler (so nothing emitted earlier is lost or reordered), and
/// from then on [`EventSink::emit`] calls the handler on the emitting thread.
pub struct EventSink {
    tx: Sender<Event>,
    rx: Receiver<Event>,
    handler: OnceLock<EventHandler>,
}

impl Default for EventSink {
    fn default() -> Self {
        let (tx, rx) = crossbeam_channel::unbounded();
        EventSink {
            tx,
            rx,
            handler: OnceLock::new(),
        }
    }
}

impl EventSink {
    /// Hands `ev` to the handler if one is set, else queues it on the channel (which never
    /// fails: the sink holds a receiver itself).
    pub fn emit(&self, ev: Event) {
        match self.handler.get() {
            Some(h) => h(ev),
            None => {
                let _ = self.tx.send(ev);
            }
        }
    }

    /// Installs `handler` and passes it the events queued so far. False if a handler was
    /// already set (the first one stays).
    pub fn set_handler(&self, handler: EventHandler) -> bool {
        // Events already queued (links that came up before) go to the handler first.
        let ok = self.handler.set(handler).is_ok();
        if ok {
            let h = self.handler.get().expect("just set");
            while let Ok(ev) = self.rx.try_recv() {
                h(ev);
            }
        }
        ok
    }

    /// A handle to the event channel; every call returns one to the same channel.
    pub fn receiver(&self) -> EventReceiver {
        self.rx.clone()
    }
}
