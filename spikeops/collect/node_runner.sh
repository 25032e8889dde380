# spikeops node runner, protocol S1: every probe of a node in one SSH session.
#
# The collector runs `exec sh -s` and writes this file to the session's stdin, then
# `_s1_start QUIET SPOOL_DIR...`, one line per probe (`_r INDEX KEEP_BLOCKS TIMEOUT 'COMMAND'`) as
# slots free up, and `_f` when there is nothing more to run. Only POSIX sh and the commands
# every Linux node has (mktemp, mkfifo, cat, head, wc, rm, sleep, kill) are used: dash,
# busybox sh and bash all run it, and nothing is installed on the node.
#
# Each probe runs in the background with stdin from /dev/null: at most KEEP_BLOCKS 512-byte
# blocks of its stdout and 129 of its stderr are kept in a private spool directory (mode
# 0700, removed at the end), its exit status in a third file; the rest of a flood is
# discarded on the node. The probes run concurrently, so one that hangs or floods cannot
# delay the others. One emitter process is the only writer of the session's stdout. It sends
# finished probes as frames:
#
#   S1 x INDEX STATUS STATE NOUT NERR\n   then NOUT bytes of stdout and NERR bytes of stderr
#   S1 b COUNT\n   then COUNT `S1 x` lines, then each one's bytes in the same order
#
# STATUS is the exit status (`-` if the probe never reported one); STATE is `done`, or
# `stuck` when the probe still held its output open 2.5-3 s after its TIMEOUT (`timeout` on
# the node has killed it by then; something it left behind keeps the pipe open): what it had
# written is sent and it is no longer waited for. The session starts with `S1 hello 1` (or
# `S1 fail REASON` when no spool directory can be made, and the collector falls back to a
# session per probe) and ends with `S1 end`. Time is kept in half-second ticks by a ticker
# process, since POSIX sh has no clock; it first sleeps QUIET seconds (the shortest probe
# timeout: nothing can be overdue before), so a session that ends sooner costs one `sleep`. Events reach the emitter through a FIFO (lines under
# PIPE_BUF bytes, so writes from many processes never interleave): `s I T` a probe started,
# `d I` it finished, `t N` N half-seconds passed, `f` no more probes, `q` the runner is gone.

_s1_start() {
    umask 077
    _s1_quiet=$1
    shift
    _s1_dir=
    for _s1_base do
        [ -d "$_s1_base" ] && [ -w "$_s1_base" ] || continue
        _s1_dir=$(mktemp -d "$_s1_base/spikeops.XXXXXX" 2>/dev/null) && [ -d "$_s1_dir" ] && break
        _s1_dir=
    done
    if [ -z "$_s1_dir" ]; then
        printf 'S1 fail no writable spool directory among: %s\n' "$*"
        exit 0
    fi
    trap 'rm -rf "$_s1_dir"' EXIT
    trap 'exit 129' HUP
    trap 'exit 141' PIPE
    trap 'exit 143' TERM
    if ! mkfifo "$_s1_dir/q" 2>/dev/null; then
        printf 'S1 fail cannot make a FIFO in %s\n' "$_s1_base"
        exit 0
    fi
    exec 5<>"$_s1_dir/q"
    _s1_main=$$
    printf 'S1 hello 1\n'
    _s1_emit 2>/dev/null &
    _s1_emitter=$!
    _s1_tick >/dev/null 2>&1 &
    _s1_ticker=$!
}

# _r INDEX KEEP_BLOCKS TIMEOUT COMMAND: start one probe. COMMAND is what a session per probe
# would run after `exec` (`timeout -k 2 T ...`); it runs in a subshell of this shell, its exit
# status recorded. Its stdout and stderr reach their files through `cat`, which writes what it
# reads at once (a probe that is given up on has sent what it printed), under a file-size
# limit of KEEP_BLOCKS (stdout) and 129 (stderr) 512-byte blocks. At its limit the stdout
# `cat` stops, and the probe meets a closed pipe as it would meet the collector closing its
# channel; past the stderr limit the rest is drained, as the collector drops it. SIGXFSZ is
# ignored by the two `cat`s (not by the probe), so a limit is an error, never a core dump.
_r() {
    echo "s $1 $3" >&5
    (
        { { eval "$4" 2>&1 >&4 4>&- 5>&-; echo "$?" >"$_s1_dir/x$1"; } |
            { trap '' XFSZ; ulimit -f 129 2>/dev/null; cat >"$_s1_dir/e$1" || exec cat >/dev/null; }; } 4>&1 |
            { trap '' XFSZ; ulimit -f "$2" 2>/dev/null; exec cat >"$_s1_dir/o$1"; }
        : >"$_s1_dir/d$1"
        echo "d $1" >&5
    ) </dev/null >/dev/null 2>&1 &
}

# _f: no more probes; wait until each started one is sent, then end the session.
_f() {
    echo f >&5
    wait "$_s1_emitter"
    kill "$_s1_ticker" 2>/dev/null
    exit 0
}

_s1_tick() {
    sleep "$_s1_quiet"
    echo "t $((2 * _s1_quiet))" >&5
    while kill -0 "$_s1_main" 2>/dev/null; do
        if sleep 0.5 2>/dev/null; then echo 't 1'; else sleep 1; echo 't 2'; fi >&5
    done
    echo q >&5
}

_s1_emit() {
    cd "$_s1_dir" || exit 1
    _s1_now=0 _s1_open=0 _s1_live=' ' _s1_last=
    while read -r _s1_ev _s1_i _s1_arg <&5; do
        case $_s1_ev in
            s)  _s1_live="$_s1_live$_s1_i "
                _s1_open=$((_s1_open + 1))
                eval "_s1_due$_s1_i=\$((_s1_now + 2 * _s1_arg + 6))" ;;
            d)  _s1_batch ;;
            t)  _s1_now=$((_s1_now + _s1_i))
                for _s1_j in $_s1_live; do
                    eval "[ \"\$_s1_now\" -ge \"\$_s1_due$_s1_j\" ]" && _s1_send "$_s1_j" stuck
                done ;;
            f)  _s1_last=1 ;;
            q)  exit 0 ;;
        esac
        if [ -n "$_s1_last" ] && [ "$_s1_open" -eq 0 ]; then
            break
        fi
    done
    printf 'S1 end\n'
}

# _s1_batch: every live probe that has finished (its d file exists), in one frame group:
# `S1 b COUNT`, COUNT `S1 x` headers, then their bytes in the same order. Probes of a wave
# finish together, so one `wc` and one `cat` serve several probes. The files are then
# emptied (no process needed); the directory goes when the session ends.
_s1_batch() {
    _s1_ready= _s1_files= _s1_count=0
    for _s1_j in $_s1_live; do
        [ -e "d$_s1_j" ] || continue
        _s1_ready="$_s1_ready $_s1_j"
        _s1_files="$_s1_files o$_s1_j e$_s1_j"
        _s1_count=$((_s1_count + 1))
        _s1_live="${_s1_live%% $_s1_j *} ${_s1_live#* $_s1_j }"
    done
    [ "$_s1_count" -gt 0 ] || return 0
    _s1_open=$((_s1_open - _s1_count))
    set -- $(wc -c $_s1_files 2>/dev/null)
    if [ "$#" -ne $((4 * _s1_count + 2)) ]; then
        for _s1_j in $_s1_ready; do printf 'S1 x %s - done 0 0\n' "$_s1_j"; done
        return 0
    fi
    printf 'S1 b %s\n' "$_s1_count"
    for _s1_j in $_s1_ready; do
        _s1_status=-
        [ -s "x$_s1_j" ] && read -r _s1_status <"x$_s1_j"
        printf 'S1 x %s %s done %s %s\n' "$_s1_j" "${_s1_status:--}" "$1" "$3"
        shift 4
    done
    cat $_s1_files
    for _s1_j in $_s1_ready; do
        : >"o$_s1_j"
        : >"e$_s1_j"
    done
}

# _s1_send INDEX stuck: one probe given up on. Its files may still grow, so exactly the sizes
# counted are sent.
_s1_send() {
    case $_s1_live in *" $1 "*) ;; *) return 0 ;; esac
    _s1_live="${_s1_live%% $1 *} ${_s1_live#* $1 }"
    _s1_open=$((_s1_open - 1))
    _s1_status=-
    [ -s "x$1" ] && read -r _s1_status <"x$1"
    set -- "$1" "$2" $(wc -c "o$1" "e$1" 2>/dev/null)
    if [ "$#" -lt 6 ]; then
        printf 'S1 x %s - %s 0 0\n' "$1" "$2"
        return 0
    fi
    printf 'S1 x %s %s %s %s %s\n' "$1" "${_s1_status:--}" "$2" "$3" "$5"
    head -c "$3" "o$1"
    head -c "$5" "e$1"
}
