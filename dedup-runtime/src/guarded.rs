//! [`Guarded`]: a pooled connection that is closed, not pooled, unless its user says it is
//! clean. A ground-floor file: it imports nothing of this crate.

use sqlx::Database;
use sqlx::pool::PoolConnection;

/// A pooled connection that may be left in a transaction sqlx does not track (begun with
/// plain SQL) or with a changed session (MySQL's `autocommit`): closed, never pooled, when
/// it is dropped before [`set_clean`](Self::set_clean) — a cancelled call, a panic.
pub(crate) struct Guarded<DB: Database> {
    conn: PoolConnection<DB>,
    clean: bool,
}

impl<DB: Database> Guarded<DB> {
    pub(crate) fn new(conn: PoolConnection<DB>) -> Self {
        Guarded { conn, clean: false }
    }

    /// The transaction ended and the session is as the pool gave it: pool it again.
    pub(crate) fn set_clean(&mut self) {
        self.clean = true;
    }
}

impl<DB: Database> std::ops::Deref for Guarded<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.conn
    }
}

impl<DB: Database> std::ops::DerefMut for Guarded<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }
}

impl<DB: Database> Drop for Guarded<DB> {
    fn drop(&mut self) {
        if !self.clean {
            self.conn.close_on_drop();
        }
    }
}
