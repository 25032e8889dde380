# spikeops node runner, protocol S2: every probe of a node in one SSH session.
#
# The collector runs `exec sh -s` and writes this file to the session's stdin, then
# `_s2_start TOKEN SPOOL_DIR...`, one line per probe (`_r INDEX BLOCKS TIMEOUT 'COMMAND'`) as
# slots free up, `_g INDEX...` for probes it gives up on, and `_f` when there is nothing more to
# run. Only POSIX sh and the commands every Linux node has (mkdir, mkfifo, tar, rm, timeout)
# are used: dash, busybox sh and bash all run it, GNU and busybox tar both serve, and nothing
# is installed on the node.
#
# Each probe runs in the background, in a subshell of this shell, with stdin from /dev/null
# and its stdout and stderr written straight into files of a private spool directory
# (`spikeops-TOKEN`, mode 0700, removed at the end) under a file-size limit (`ulimit -f
# BLOCKS`, 512-byte blocks: the probe's cap plus one byte, at least 64 KiB). A probe that
# floods meets the limit as SIGXFSZ (or EFBIG where it ignores that signal) and stops; the
# extra byte tells the collector the output went past its cap. No process sits between a
# probe and its files, so a probe costs the node its subshell, its `timeout` and itself. Its
# exit status goes to a third file, then an event to the one emitter, the only writer of the
# session's stdout, which sends finished probes in groups:
#
#   S2 t COUNT NFILES\n   COUNT lines `INDEX STATUS STATE`, then, when NFILES > 0, one tar
#                         archive of the NFILES non-empty files among oINDEX (stdout) and
#                         eINDEX (stderr) of those probes
#
# tar writes each file's size in its header and then exactly that many bytes, so what a probe
# (or a child it left behind) writes after the size was taken cannot break the framing.
# STATUS is the exit status (`-` if the probe never reported one); STATE is `done`, or `stuck`
# for a probe the collector gave up on (`_g`, 3 s after its TIMEOUT: `timeout` has killed it
# by then, but a process in uninterruptible sleep outlives that): what it had written is sent
# and it is no longer waited for. Keeping time is the collector's, so no clock process runs
# here. The session starts with `S2 hello 2` (or `S2 fail REASON` when the node has no tar or
# no spool directory, and the collector falls back to a session per probe); once every started
# probe is sent after `_f`, the emitter writes `S2 end` and the collector closes the session.
# The end of this shell's stdin (the session closed, or the collector gone) ends the runner:
# the emitter stops (`q`), the spool directory is removed, and probes still running are left
# to their `timeout`. Events reach the emitter through a FIFO (lines under PIPE_BUF bytes, so
# writes from many processes never interleave): `s I` a probe started, `d I` it finished,
# `g I...` give up on these, `f` no more probes, `q` stop now. The emitter holds only the
# FIFO's reading end, so it also stops at end of file, once every writer is gone.

_s2_start() {
    umask 077
    _s2_token=$1
    shift
    if ! command -v tar >/dev/null 2>&1; then
        printf 'S2 fail no tar on the node\n'
        exit 0
    fi
    _s2_dir=
    for _s2_base do
        [ -d "$_s2_base" ] && [ -w "$_s2_base" ] || continue
        if mkdir "$_s2_base/spikeops-$_s2_token" 2>/dev/null; then
            _s2_dir=$_s2_base/spikeops-$_s2_token
            break
        fi
    done
    if [ -z "$_s2_dir" ]; then
        printf 'S2 fail no writable spool directory among: %s\n' "$*"
        exit 0
    fi
    trap 'rm -rf "$_s2_dir"' EXIT
    trap 'exit 129' HUP
    trap 'exit 141' PIPE
    trap 'exit 143' TERM
    if ! mkfifo "$_s2_dir/q" 2>/dev/null; then
        printf 'S2 fail cannot make a FIFO in %s\n' "$_s2_base"
        exit 0
    fi
    exec 5<>"$_s2_dir/q"
    trap 'echo q >&5; rm -rf "$_s2_dir"' EXIT
    printf 'S2 hello 2\n'
    (exec 6<"$_s2_dir/q" 5>&- 2>/dev/null; _s2_emit) &
}

# _r INDEX BLOCKS TIMEOUT COMMAND: start one probe. COMMAND is what a session per probe would
# run after `exec` (`timeout -k 2 T ...`). A limit that cannot be set (a lower hard limit) is
# reported as the probe's failure rather than run without a cap. No core file is written when
# the limit stops a probe. The probe runs as a background job that is then waited for: the
# same processes as in the foreground, but a shell reports a foreground job killed by a
# signal ("File size limit exceeded") on its stderr, which would land in the probe's.
_r() {
    echo "s $1" >&5
    (
        ulimit -c 0 2>/dev/null
        if ulimit -f "$2" 2>/dev/null; then
            eval "$4"' >"$_s2_dir/o$1" 2>"$_s2_dir/e$1" 5>&- &'
            wait "$!"
            echo "$?" >"$_s2_dir/x$1"
        else
            echo "spikeops: cannot set the output limit (ulimit -f $2)" >"$_s2_dir/e$1"
            echo 126 >"$_s2_dir/x$1"
        fi
        echo "d $1" >&5
    ) </dev/null >/dev/null 2>&1 &
}

# _g INDEX...: the collector gives up on these probes; _f: nothing more will start.
_g() {
    echo "g $*" >&5
}

_f() {
    echo f >&5
}

_s2_emit() {
    cd "$_s2_dir" || exit 1
    _s2_open=0 _s2_live=' ' _s2_last=
    while read -r _s2_ev _s2_args <&6; do
        case $_s2_ev in
            s)  _s2_live="$_s2_live$_s2_args "
                _s2_open=$((_s2_open + 1)) ;;
            d)  _s2_list=
                for _s2_j in $_s2_live; do
                    [ -s "x$_s2_j" ] && _s2_list="$_s2_list $_s2_j"
                done
                [ -z "$_s2_list" ] || _s2_send done $_s2_list ;;
            g)  _s2_list=
                for _s2_j in $_s2_args; do
                    case $_s2_live in *" $_s2_j "*) ;; *) continue ;; esac
                    [ -s "x$_s2_j" ] || _s2_list="$_s2_list $_s2_j"  # else its own event follows
                done
                [ -z "$_s2_list" ] || _s2_send stuck $_s2_list ;;
            f)  _s2_last=1 ;;
            q)  exit 0 ;;
        esac
        if [ -n "$_s2_last" ] && [ "$_s2_open" -eq 0 ]; then
            break
        fi
    done
    printf 'S2 end\n'
}

# _s2_send STATE INDEX...: one group. Probes of a wave finish together, so one tar serves
# several. Files of finished probes are then emptied (no process needed); the directory goes
# when the session ends.
_s2_send() {
    _s2_state=$1
    shift
    _s2_head= _s2_files= _s2_n=0
    for _s2_j do
        _s2_status=-
        [ -s "x$_s2_j" ] && read -r _s2_status <"x$_s2_j"
        _s2_head="$_s2_head$_s2_j ${_s2_status:--} $_s2_state
"
        for _s2_f in "o$_s2_j" "e$_s2_j"; do
            [ -s "$_s2_f" ] || continue
            _s2_files="$_s2_files $_s2_f"
            _s2_n=$((_s2_n + 1))
        done
        _s2_live="${_s2_live%% $_s2_j *} ${_s2_live#* $_s2_j }"
        _s2_open=$((_s2_open - 1))
    done
    printf 'S2 t %s %s\n%s' "$#" "$_s2_n" "$_s2_head"
    if [ "$_s2_n" -gt 0 ]; then
        TAR_OPTIONS='--blocking-factor=1 --numeric-owner --format=gnu' tar -cf - $_s2_files 2>/dev/null
    fi
    [ "$_s2_state" = done ] || return 0
    for _s2_j do
        : >"o$_s2_j"
        : >"e$_s2_j"
    done
}
