# Sourced by .ci/run: start a throwaway PostgreSQL server on the loopback interface and export
# MARBLE_TEST_DATABASE_URL so the storage tests also run against PostgreSQL. Never fatal: when the
# server cannot be installed or started, it says why and the suite runs on SQLite alone (those tests
# are skipped with that reason). `marble_pg_stop` stops the server again.

marble_pg_start() {
    if [ -n "${MARBLE_TEST_DATABASE_URL:-}" ]; then
        echo "PostgreSQL: using the given MARBLE_TEST_DATABASE_URL"
        return 0
    fi
    local bindir
    bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$bindir" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "PostgreSQL: installing the Debian package"
        if ! { timeout 600 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 900 \
                apt-get install -y -qq --no-install-recommends postgresql >/dev/null; }; then
            echo "PostgreSQL: apt-get install failed; its tests will be skipped"
            return 0
        fi
        bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    fi
    if [ -z "$bindir" ]; then
        echo "PostgreSQL: no server binaries (apt-get needs root); its tests will be skipped"
        return 0
    fi
    local as_user=() owner
    owner=$(id -un)
    if [ "$(id -u)" = 0 ]; then  # the server refuses to run as root
        if ! id postgres >/dev/null 2>&1; then
            echo "PostgreSQL: no 'postgres' user to run the server as; its tests will be skipped"
            return 0
        fi
        local runuser  # /usr/sbin is not on every CI shell's PATH
        runuser=$(command -v runuser || ls /usr/sbin/runuser /sbin/runuser 2>/dev/null | head -n 1)
        if [ -z "$runuser" ]; then
            echo "PostgreSQL: no runuser to start the server as 'postgres'; its tests will be skipped"
            return 0
        fi
        as_user=("$runuser" -u postgres --)
        owner=postgres
    fi
    MARBLE_PG_DIR=$(mktemp -d /tmp/marble-pg.XXXXXX)
    chown "$owner" "$MARBLE_PG_DIR"
    local port
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # UTF8 whatever the caller's locale: with none set (a bare CI shell) initdb picks SQL_ASCII, psycopg then
    # returns the server version as bytes and SQLAlchemy cannot parse it.
    if ! "${as_user[@]}" "$bindir/initdb" -D "$MARBLE_PG_DIR/data" -U postgres -A trust --no-sync -E UTF8 --locale=C \
            >"$MARBLE_PG_DIR/initdb.log" 2>&1; then
        echo "PostgreSQL: initdb failed ($(tail -n 3 "$MARBLE_PG_DIR/initdb.log" | tr '\n' ' ')); its tests will be skipped"
        return 0
    fi
    if ! "${as_user[@]}" "$bindir/pg_ctl" -D "$MARBLE_PG_DIR/data" -l "$MARBLE_PG_DIR/server.log" -w -t 60 \
            -o "-c listen_addresses=127.0.0.1 -p $port -k $MARBLE_PG_DIR -c fsync=off -c max_connections=200" \
            start >/dev/null; then
        echo "PostgreSQL: the server did not start ($(tail -n 3 "$MARBLE_PG_DIR/server.log" | tr '\n' ' ')); its tests will be skipped"
        return 0
    fi
    MARBLE_PG_BIN=$bindir
    MARBLE_PG_AS=("${as_user[@]}")
    export MARBLE_TEST_DATABASE_URL="postgresql+psycopg://postgres@127.0.0.1:$port/postgres"
    echo "PostgreSQL: server $("$bindir/postgres" --version | awk '{print $3}') on 127.0.0.1:$port for the tests"
}

marble_pg_stop() {
    if [ -n "${MARBLE_PG_BIN:-}" ]; then
        "${MARBLE_PG_AS[@]}" "$MARBLE_PG_BIN/pg_ctl" -D "$MARBLE_PG_DIR/data" -m immediate stop >/dev/null 2>&1 || true
        rm -rf "$MARBLE_PG_DIR"
    fi
}
