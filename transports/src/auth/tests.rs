use super::*;
use std::net::TcpListener;

fn transcript() -> Transcript {
    Transcript {
        channel: Channel::Tcp,
        dialler: 3,
        acceptor: 1,
        dialler_nonce: [7; NONCE_LEN],
        acceptor_nonce: [9; NONCE_LEN],
    }
}

#[test]
fn mac_binds_ids_nonces_role_channel_and_key() {
    let key = b"0123456789abcdef-key";
    let t = transcript();
    let tag = t.tag(key, Role::Dialler);
    assert!(t.verify(key, Role::Dialler, &tag));
    // Every bound field changes the tag.
    let swapped_ids = Transcript {
        dialler: t.acceptor,
        acceptor: t.dialler,
        ..t
    };
    let swapped_nonces = Transcript {
        dialler_nonce: t.acceptor_nonce,
        acceptor_nonce: t.dialler_nonce,
        ..t
    };
    let other_channel = Transcript {
        channel: Channel::Verbs,
        ..t
    };
    let mut fresh = t;
    fresh.acceptor_nonce[31] ^= 1;
    for (what, other) in [
        ("swapped ids", swapped_ids),
        ("swapped nonces", swapped_nonces),
        ("other channel", other_channel),
        ("another nonce", fresh),
    ] {
        assert!(!other.verify(key, Role::Dialler, &tag), "{what}");
    }
    assert!(
        !t.verify(key, Role::Acceptor, &tag),
        "reflected to the other role"
    );
    assert!(
        !t.verify(b"0123456789abcdef-kez", Role::Dialler, &tag),
        "other key"
    );
    assert!(!t.verify(b"", Role::Dialler, &tag), "no key");
    assert!(!t.verify(key, Role::Dialler, &tag[..31]), "truncated tag");
    let mut bad = tag;
    bad[0] ^= 0x80;
    assert!(!t.verify(key, Role::Dialler, &bad), "flipped bit");
}

#[test]
fn secrets_are_checked_and_never_shown() {
    assert!(matches!(
        ClusterSecret::new(b"short"),
        Err(AuthError::WeakSecret { len: 5 })
    ));
    let s = ClusterSecret::parse("  0123456789abcdef\n").unwrap();
    assert_eq!(s, ClusterSecret::new(b"0123456789abcdef").unwrap());
    assert_eq!(format!("{s:?}"), "ClusterSecret(<16 bytes>)");
    let a = generate_secret_text().unwrap();
    let b = generate_secret_text().unwrap();
    assert_eq!(a.len(), 64);
    assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(a, b);
    assert_ne!(
        ClusterSecret::random().unwrap(),
        ClusterSecret::random().unwrap()
    );
}

#[test]
fn membership() {
    let open = AuthConfig::default();
    assert!(open.is_member(0, 5) && !open.is_member(5, 5));
    let three = AuthConfig {
        members: Some(3),
        ..AuthConfig::default()
    };
    assert!(three.is_member(0, 2));
    assert!(!three.is_member(0, 3) && !three.is_member(2, 2) && !three.is_member(0, u32::MAX));
}

fn cfg(secret: Option<&str>, members: Option<u32>) -> AuthConfig {
    AuthConfig {
        secret: secret.map(|s| ClusterSecret::parse(s).unwrap()),
        members,
        handshake_timeout: Duration::from_secs(2),
    }
}

/// Runs `dial` on a client socket and `accept` on the accepted one; returns both outcomes.
fn run(
    dialler: AuthConfig,
    acceptor: AuthConfig,
    me: NodeId,
    peer: NodeId,
) -> (Result<(), AuthError>, Result<NodeId, AuthError>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let acc = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let a = accept(&mut s, &acceptor, Channel::Tcp, peer)?;
        let id = a.peer;
        a.accept(&mut s)?;
        Ok(id)
    });
    let mut s = TcpStream::connect(addr).unwrap();
    let d = dial(&mut s, &dialler, Channel::Tcp, me, peer, Duration::ZERO);
    drop(s);
    (d, acc.join().unwrap())
}

const SECRET: &str = "a cluster secret of some length";

#[test]
fn handshake_accepts_the_same_secret() {
    let (d, a) = run(cfg(Some(SECRET), Some(4)), cfg(Some(SECRET), Some(4)), 2, 0);
    d.unwrap();
    assert_eq!(a.unwrap(), 2);
    // Without secrets on both sides the exchange still runs (unauthenticated).
    let (d, a) = run(cfg(None, None), cfg(None, None), 1, 0);
    d.unwrap();
    assert_eq!(a.unwrap(), 1);
}

#[test]
fn handshake_refuses_a_wrong_or_missing_secret() {
    for (dialler, acceptor) in [
        (Some("another secret, same length!!!!"), Some(SECRET)),
        (None, Some(SECRET)),
        (Some(SECRET), None),
    ] {
        let (d, a) = run(cfg(dialler, None), cfg(acceptor, None), 1, 0);
        // The dialler checks the acceptor's proof first and hangs up.
        assert!(matches!(d, Err(AuthError::BadProof)), "{d:?}");
        assert!(a.is_err(), "acceptor admitted a wrong secret");
    }
}

#[test]
fn handshake_refuses_non_members_and_misaddressed_challenges() {
    let (d, a) = run(cfg(Some(SECRET), None), cfg(Some(SECRET), Some(3)), 3, 0);
    assert!(
        matches!(d, Err(AuthError::Refused(Status::NotMember))),
        "{d:?}"
    );
    assert!(matches!(a, Err(AuthError::NotMember { id: 3 })), "{a:?}");
    // A node claiming the acceptor's own id.
    let (d, a) = run(cfg(Some(SECRET), None), cfg(Some(SECRET), None), 0, 0);
    assert!(
        matches!(d, Err(AuthError::Refused(Status::NotMember))),
        "{d:?}"
    );
    assert!(matches!(a, Err(AuthError::NotMember { id: 0 })), "{a:?}");
}

#[test]
fn a_trickling_dialler_is_dropped_at_the_deadline() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let trickle = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut c = [0u8; CHALLENGE_LEN];
        header(&mut c, VERSION, Channel::Tcp, 1, 0);
        for b in c {
            if s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let (mut s, _) = l.accept().unwrap();
    let c = AuthConfig {
        handshake_timeout: Duration::from_millis(300),
        ..cfg(Some(SECRET), None)
    };
    let t0 = Instant::now();
    let r = accept(&mut s, &c, Channel::Tcp, 0);
    assert!(matches!(r, Err(AuthError::Timeout)), "{r:?}");
    assert!(
        t0.elapsed() < Duration::from_millis(1000),
        "{:?}",
        t0.elapsed()
    );
    drop(s);
    trickle.join().unwrap();
}

#[test]
fn garbage_and_foreign_channels_are_malformed() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    for msg in [vec![0xffu8; CHALLENGE_LEN], {
        let mut c = vec![0u8; CHALLENGE_LEN];
        header(&mut c, VERSION, Channel::Verbs, 1, 0);
        c
    }] {
        let w = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&msg).unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        let (mut s, _) = l.accept().unwrap();
        let r = accept(&mut s, &cfg(Some(SECRET), None), Channel::Tcp, 0);
        assert!(matches!(r, Err(AuthError::Malformed(_))), "{r:?}");
        drop(s);
        w.join().unwrap();
    }
}
